#!/usr/bin/env bash
# The sanitizer and fuzz trees of ./build.sh test, at -O1 -g1 (fast to build, close enough to
# release to find real bugs); tools/test_summary.py counts their tests with the main tree's.
#   tools/sanitizers.sh asan   build-asan: gcc, AddressSanitizer + UndefinedBehaviorSanitizer,
#                              without CUDA. Builds every target (so a CI run proves the tree
#                              builds without CUDA) and runs every local-backend test but the
#                              exhaustive dtensor sweeps (FSDP, checkpoints, fsdp-train, the
#                              programs' bad inputs and hostile checkpoints included), the CUDA /
#                              NCCL refusals of a build without them, and a few mpirun tests
#                              (OpenMPI's own leaks suppressed: tools/sanitizers/lsan.supp)
#   tools/sanitizers.sh tsan   build-tsan: gcc, ThreadSanitizer, no MPI: the collectives and
#                              dtensor tests that run rank threads
#   tools/sanitizers.sh fuzz   build-fuzz: clang + libFuzzer: layout-fuzz (the mesh and
#                              placement parsers and the layout rules) for FUZZ_SECONDS (30) s
#   tools/sanitizers.sh KIND build   only configure and build the tree (./build.sh test builds the
#                                    next tree at idle CPU priority while the current one's tests run)
#   tools/sanitizers.sh KIND test    only run the tests of a tree built before
# A sanitizer report fails the test that triggered it (halt_on_error).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

usage="usage: tools/sanitizers.sh asan|tsan|fuzz [build|test]"
kind=${1:?$usage}
step=${2:-all}
case $step in all|build|test) ;; *) echo "$usage" >&2; exit 2 ;; esac
setup_env=()
cpp_args="'-g1'"
case $kind in
  asan)
    dir=build-asan
    # The programs and tests at -O0 (they parse flags, drive the libraries and check results; the
    # libraries stay at -O1): halves their compile time under ASan.
    opts=(-Db_sanitize=address,undefined -Dtest_optimization=0 -Dprogram_optimization=0)
    # UBSan without its alignment and null checks: together they instrument every pointer access
    # and doubled this tree's compile time (executor.cpp 21.7 -> 12.2 s, vec_sse2.cpp 40 -> 22 s).
    # ASan still reports a null dereference (SEGV, with the stack); a misaligned access is legal
    # on the x86 CPUs this tree runs on, and no CUDA code is built here.
    cpp_args="'-g1','-fno-sanitize=alignment,null'"
    targets=()  # all: the build without CUDA
    tests=(kernels kernels-ops collectives-local collectives-nccl dtensor-ops nn checkpoint-hostile
           kernels-gpu kernels-gpu-ops nn-gpu collectives-nccl-gpu  # "this build has no CUDA": skipped
           conformance cli-layout cli-redistribute fuzz bench-smoke
           bench-smoke-detects-wrong dtensor-bench-smoke dtensor-bench-odd-world dtensor-bench-host-cost
           bad-inputs layout-example api-example dtensor-asan dtensor-asan-planner fsdp fsdp-meta fsdp-estimate fsdp-lowp
           fsdp-dp-chunks checkpoint-save-plan
           checkpoint fsdp-train-fsdp4
           fsdp-train-hsdp2x2xtp2-bf16 fsdp-train-checkpoint-resume fsdp-train-fp16
           fsdp-param-mesh fsdp-train-hsdp2x2-ep2carved fsdp-contiguous fsdp-train-fsdp4-contiguous-bf16 fsdp-offload)
    ;;
  tsan)
    dir=build-tsan
    opts=(-Db_sanitize=thread -Dmpi=disabled)
    targets=(tests/collectives/collectives_test tests/dtensor/dtensor_test)
    tests=(collectives-tsan dtensor-tsan dtensor-tsan-redistribute)
    ;;
  fuzz)
    dir=build-fuzz
    if ! command -v clang++ >/dev/null; then
      echo "sanitizers.sh: clang++ not found (tools/setup.sh installs clang and libclang-rt-dev)" >&2
      exit 1
    fi
    if command -v ccache >/dev/null; then setup_env=("CC=ccache clang" "CXX=ccache clang++")
    else setup_env=(CC=clang CXX=clang++); fi
    opts=(-Dmpi=disabled "-Dfuzz_seconds=${FUZZ_SECONDS:-30}")
    targets=(tests/fuzz/layout_fuzz)
    tests=(layout-fuzz)
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

source tools/ccache_env.sh
if [ "$step" != test ]; then
rm -f "$dir"/meson-logs/testlog*.json  # a failed build must not leave the last run's results behind
if [ ! -f "$dir/build.ninja" ]; then
  echo "sanitizers: configuring $dir"
  env "${setup_env[@]}" meson setup "$dir" --buildtype=plain -Doptimization=1 "-Dcpp_args=[$cpp_args]" -Dcuda=disabled \
    "${opts[@]}" >"$dir.setup.log" 2>&1 || { cat "$dir.setup.log"; exit 1; }
  rm -f "$dir.setup.log"
elif [ "$kind" = fuzz ]; then
  meson configure "$dir" "-Dfuzz_seconds=${FUZZ_SECONDS:-30}" >/dev/null
fi
# ninja prints a failed command's output on stdout: keep both for the failure message.
ninja -C "$dir" --quiet "${targets[@]}" >"$dir.ninja.log" 2>&1 || { tail -n 60 "$dir.ninja.log"; exit 1; }
rm -f "$dir.ninja.log"
fi
mpi_tests=()
if [ "$kind" = asan ] && grep -qx 'mpi=true' "$dir/features.txt" && command -v mpirun >/dev/null; then
  [ "$step" = test ] || ninja -C "$dir" --quiet tests/collectives/collectives_mpi_test >/dev/null
  mpi_tests=(collectives-mpi-np2 redistribute-mpi rank-failure)
fi
[ "$step" != build ] || exit 0
if [ ! -f "$dir/build.ninja" ]; then
  echo "sanitizers.sh: $dir is not built (tools/sanitizers.sh $kind build)" >&2
  exit 1
fi

supp=$here/tools/sanitizers
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:allocator_may_return_null=1:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
echo "== meson test -C $dir (${kind})"
status=0
# --setup sanitize: the test setup that includes suite 'sanitize' (dtensor-asan*, dtensor-tsan*).
meson test -C "$dir" --setup sanitize --no-rebuild --print-errorlogs --num-processes 2 "${tests[@]}" || status=1
if ((${#mpi_tests[@]})); then
  # Processes under mpirun: OpenMPI unloads its plugins before LeakSanitizer reports, so their
  # leaks resolve to a module (and match lsan.supp) only with full unwinding on malloc (slow,
  # hence only here; tests/cli/sanitizer_env.py does the same for single mpi processes).
  LSAN_OPTIONS="$LSAN_OPTIONS:fast_unwind_on_malloc=0" meson test -C "$dir" --setup sanitize --no-rebuild --print-errorlogs \
    --logbase testlog-mpi "${mpi_tests[@]}" || status=1
fi
exit $status
