#!/usr/bin/env bash
# The two commands of the README:
#   ./build.sh demo   install what is missing, build, run the main job on the local backend
#   ./build.sh test   install what is missing, build, run every test; the last line is
#                     "N passed, N failed" and the exit status is non-zero on any failure.
# When the default build found CUDA, the test command also builds and tests a second tree with
# -Dcuda=disabled, so every change is proven to build and pass without CUDA too. It then runs
# the sanitizer and fuzz trees (tools/sanitizers.sh): ASan + UBSan, TSan, and libFuzzer for
# FUZZ_SECONDS (default 30) seconds; their tests count in the closing line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

case "${1:-}" in
  demo)
    tools/setup.sh build
    exec tools/demo.sh
    ;;
  test)
    tools/setup.sh build
    dirs=(build)
    if grep -qx 'cuda=true' build/features.txt; then
      tools/setup.sh build-nocuda -Dcuda=disabled
      dirs+=(build-nocuda)
    fi
    status=0
    for d in "${dirs[@]}"; do
      echo "== meson test -C $d ($(tr '\n' ' ' < "$d/features.txt"))"
      meson test -C "$d" --print-errorlogs --num-processes 2 || status=1
    done
    for kind in asan tsan fuzz; do
      tools/sanitizers.sh "$kind" || status=1
      dirs+=("build-$kind")
    done
    python3 tools/test_summary.py "${dirs[@]}" || status=1
    exit $status
    ;;
  *)
    echo "usage: ./build.sh demo | test" >&2
    exit 2
    ;;
esac
