#!/usr/bin/env bash
# The sanitizer and fuzz trees of ./build.sh test. Each is configured once, builds only the
# targets its tests need, at -O1 (fast to build, close enough to release to find real bugs),
# and runs those tests; tools/test_summary.py counts them with the main tree's.
#   tools/sanitizers.sh asan   build-asan: gcc, AddressSanitizer + UndefinedBehaviorSanitizer;
#                              every local-backend test (FSDP, checkpoints and fsdp-train included),
#                              the programs' bad inputs and one mpirun test (OpenMPI's own leaks suppressed: tools/sanitizers/lsan.supp)
#   tools/sanitizers.sh tsan   build-tsan: gcc, ThreadSanitizer, no MPI: the collectives and
#                              dtensor tests (ranks as threads)
#   tools/sanitizers.sh fuzz   build-fuzz: clang + libFuzzer: layout-fuzz (the mesh and
#                              placement parsers and the layout rules) for FUZZ_SECONDS (30) s
# A sanitizer report fails the test that triggered it (halt_on_error).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

kind=${1:?usage: tools/sanitizers.sh asan|tsan|fuzz}
setup_env=()
case $kind in
  asan)
    dir=build-asan
    opts=(-Db_sanitize=address,undefined)
    targets=(tests/kernels/kernels_test tests/collectives/collectives_test tests/dtensor/dtensor_test
             tests/conformance/conformance_test tests/dtensor-check tests/plan-quality
             bench/collectives-bench bench/dtensor-bench examples/layout-example examples/api-example
             bench/kernels-bench bench/fsdp-bench bench/checkpoint-bench examples/fsdp-train
             examples/checkpoint-tool  # every program of the bad-input runner
             tests/fsdp/fsdp_test tests/checkpoint/checkpoint_test)
    tests=(kernels collectives-local conformance cli-layout cli-redistribute fuzz bench-smoke
           bench-smoke-detects-wrong dtensor-bench-smoke dtensor-bench-odd-world dtensor-bench-host-cost
           bad-inputs layout-example api-example dtensor-asan fsdp checkpoint fsdp-train-fsdp4
           fsdp-train-hsdp2x2xtp2-bf16 fsdp-train-checkpoint-resume)
    ;;
  tsan)
    dir=build-tsan
    opts=(-Db_sanitize=thread -Dmpi=disabled)
    targets=(tests/collectives/collectives_test tests/dtensor/dtensor_test)
    tests=(collectives-local dtensor-tsan)
    ;;
  fuzz)
    dir=build-fuzz
    if ! command -v clang++ >/dev/null; then
      echo "sanitizers.sh: clang++ not found (tools/setup.sh installs clang and libclang-rt-dev)" >&2
      exit 1
    fi
    setup_env=(CC=clang CXX=clang++)
    opts=(-Dmpi=disabled "-Dfuzz_seconds=${FUZZ_SECONDS:-30}")
    targets=(tests/fuzz/layout_fuzz)
    tests=(layout-fuzz)
    ;;
  *) echo "usage: tools/sanitizers.sh asan|tsan|fuzz" >&2; exit 2 ;;
esac

rm -f "$dir"/meson-logs/testlog*.json  # a failed build must not leave the last run's results behind
if [ ! -f "$dir/build.ninja" ]; then
  echo "sanitizers: configuring $dir"
  env "${setup_env[@]}" meson setup "$dir" --buildtype=plain -Doptimization=1 -Dcpp_args=-g1 -Dcuda=disabled \
    "${opts[@]}" >"$dir.setup.log" 2>&1 || { cat "$dir.setup.log"; exit 1; }
  rm -f "$dir.setup.log"
elif [ "$kind" = fuzz ]; then
  meson configure "$dir" "-Dfuzz_seconds=${FUZZ_SECONDS:-30}" >/dev/null
fi
ninja -C "$dir" --quiet "${targets[@]}" >/dev/null 2>"$dir.ninja.log" || { cat "$dir.ninja.log"; exit 1; }
rm -f "$dir.ninja.log"
mpi_tests=()
if [ "$kind" = asan ] && grep -qx 'mpi=true' "$dir/features.txt" && command -v mpirun >/dev/null; then
  ninja -C "$dir" --quiet tests/collectives/collectives_mpi_test >/dev/null
  mpi_tests=(collectives-mpi-np2 redistribute-mpi rank-failure)
fi

supp=$here/tools/sanitizers
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:allocator_may_return_null=1:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
echo "== meson test -C $dir (${kind})"
status=0
# --setup sanitize: the test setup that includes suite 'sanitize' (dtensor-asan, dtensor-tsan).
meson test -C "$dir" --setup sanitize --no-rebuild --print-errorlogs --num-processes 2 "${tests[@]}" || status=1
if ((${#mpi_tests[@]})); then
  # Processes under mpirun: OpenMPI unloads its plugins before LeakSanitizer reports, so their
  # leaks resolve to a module (and match lsan.supp) only with full unwinding on malloc (slow,
  # hence only here; tests/cli/sanitizer_env.py does the same for single mpi processes).
  LSAN_OPTIONS="$LSAN_OPTIONS:fast_unwind_on_malloc=0" meson test -C "$dir" --setup sanitize --no-rebuild --print-errorlogs \
    --logbase testlog-mpi "${mpi_tests[@]}" || status=1
fi
exit $status
