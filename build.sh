#!/usr/bin/env bash
# The two commands of the README:
#   ./build.sh demo   install what is missing, build, run the main job on the local backend
#   ./build.sh test   install what is missing, build, run every test; the last line is
#                     "N passed, N failed" and the exit status is non-zero on any failure.
# The test command runs four trees, each covering what the others cannot (README, "Tests"):
#   build       release, CUDA when nvcc is found (the configuration users get): every test
#   build-asan  ASan + UBSan, without CUDA: builds every target, so it is also the proof that the
#               tree builds without CUDA, and runs the tests that exercise memory (tools/sanitizers.sh)
#   build-tsan  ThreadSanitizer: the threaded collectives and dtensor tests
#   build-fuzz  clang + libFuzzer: the layout fuzzer for FUZZ_SECONDS (default 30) seconds
# Each phase's wall time is printed ("== took N s: ..."); ccache makes a second run cheap.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

case "${1:-}" in
  demo)
    tools/setup.sh build
    exec tools/demo.sh
    ;;
  test)
    status=0
    dirs=()
    phase() {  # phase NAME CMD...: runs CMD, prints its wall time, records a failure
      local t0=$SECONDS
      "${@:2}" || status=1
      echo "== took $((SECONDS - t0)) s: $1"
    }
    phase "setup + build (build/)" tools/setup.sh build
    if ((status)); then  # no tests run on a stale tree
      echo "0 passed, 1 failed"
      exit 1
    fi
    echo "== meson test -C build ($(tr '\n' ' ' < build/features.txt))"
    phase "tests (build/)" meson test -C build --no-rebuild --print-errorlogs --num-processes 2
    dirs+=(build)
    for kind in asan tsan fuzz; do
      phase "sanitizer tree build-$kind" tools/sanitizers.sh "$kind"
      dirs+=("build-$kind")
    done
    echo "== took $SECONDS s in all"
    python3 tools/test_summary.py "${dirs[@]}" || status=1
    exit $status
    ;;
  *)
    echo "usage: ./build.sh demo | test" >&2
    exit 2
    ;;
esac
