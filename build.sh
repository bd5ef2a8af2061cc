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
# Each sanitizer tree is built in the background, at idle CPU priority, while the previous tree's
# tests run. Each phase's wall time is printed ("== took N s: ..."); ccache makes a second run
# cheap.
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
    # The next sanitizer tree builds in the background at idle CPU priority (SCHED_IDLE: it gets
    # only the cycles the running tests leave, so their timing is not disturbed) while the
    # current tree's tests run; its tests start once it is built.
    idle=(nice -n 19)
    if command -v chrt >/dev/null && chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0); fi
    bg_pid=0 bg_kind="" bg_t0=0
    start_build() {  # start_build KIND: builds build-KIND in the background
      bg_kind=$1 bg_t0=$SECONDS
      "${idle[@]}" tools/sanitizers.sh "$1" build >"build-$1.bg.log" 2>&1 &
      bg_pid=$!
    }
    finish_build() {  # waits for the background build; on failure prints its log
      local t0=$SECONDS rc=0
      wait "$bg_pid" || rc=$?
      echo "== took $((SECONDS - bg_t0)) s: build-$bg_kind built in the background ($((SECONDS - t0)) s waited for it)"
      if ((rc)); then cat "build-$bg_kind.bg.log"; status=1; return 1; fi
      rm -f "build-$bg_kind.bg.log"
    }
    phase "setup + build (build/)" tools/setup.sh build
    if ((status)); then  # no tests run on a stale tree
      echo "0 passed, 1 failed"
      exit 1
    fi
    echo "== meson test -C build ($(tr '\n' ' ' < build/features.txt))"
    kinds=(asan tsan fuzz)
    start_build "${kinds[0]}"
    phase "tests (build/)" meson test -C build --no-rebuild --print-errorlogs --num-processes 2
    dirs+=(build)
    for i in "${!kinds[@]}"; do
      kind=${kinds[i]} built=1
      finish_build || built=0
      if ((i + 1 < ${#kinds[@]})); then start_build "${kinds[i + 1]}"; fi
      if ((built)); then
        phase "sanitizer tree build-$kind: tests" tools/sanitizers.sh "$kind" test
      else
        echo "== build-$kind failed to build: its tests did not run"
      fi
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
