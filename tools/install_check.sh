#!/usr/bin/env bash
# The install check (meson test install-check): `meson install` of the build tree into a
# temporary DESTDIR, then the out-of-tree trainer of examples/custom-trainer (dtensor, nn, fsdp,
# checkpoint) compiled, linked and run against the installed prefix alone, once by its meson
# project through pkg-config (dtensor-runtime.pc) and once by its CMake project
# (find_package(dtensor_runtime)); on the local backend and, with MPI, under mpirun -np 4.
# Also checks that the installed headers are exactly the public ones of the source tree, that
# they compile together with nothing but the installed include folder, that the programs are
# in bin/, and that no installed file names the source or build tree.
#   tools/install_check.sh BUILD_DIR PREFIX LIBDIR INCLUDEDIR BINDIR
set -euo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "$1" && pwd)
prefix=$2 libdir=$3 includedir=$4 bindir=$5
fail() { echo "install-check: $*" >&2; exit 1; }
for tool in pkg-config cmake c++ meson ninja; do
  command -v "$tool" >/dev/null || fail "$tool not found (tools/setup.sh installs it)"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
meson install -C "$build" --no-rebuild --quiet --destdir "$tmp/root" >"$tmp/install.log" 2>&1 \
  || { cat "$tmp/install.log"; fail "meson install failed"; }
root=$tmp/root$prefix
rel() { case $1 in /*) echo "$tmp/root$1" ;; *) echo "$root/$1" ;; esac; }
inc=$(rel "$includedir")/dtensor-runtime
lib=$(rel "$libdir")
bin=$(rel "$bindir")

# Headers: exactly the public ones (every library header but the internal ones).
(cd "$src" && find kernels collectives dtensor nn checkpoint fsdp program -name '*.h' \
   | grep -v -E '^kernels/(cpu|cuda)/|^collectives/(mpi|nccl)/|^collectives/call_queue\.h$|^checkpoint/(internal|save_plan|shared)\.h$|^fsdp/(byte_pack|contiguous|group)\.h$' \
   | sort) >"$tmp/want"
(cd "$inc" && find . -name '*.h' | sed 's|^\./||' | sort) >"$tmp/got"
diff "$tmp/want" "$tmp/got" >"$tmp/headers.diff" \
  || { cat "$tmp/headers.diff"; fail "installed headers (>) differ from the public headers of the tree (<): update public_headers in meson.build"; }
[ -f "$lib/libdtensor-runtime.a" ] || fail "no $libdir/libdtensor-runtime.a"
[ -f "$lib/pkgconfig/dtensor-runtime.pc" ] || fail "no $libdir/pkgconfig/dtensor-runtime.pc"
[ -f "$lib/cmake/dtensor_runtime/dtensor_runtimeConfig.cmake" ] || fail "no CMake package config"
for p in fsdp-train checkpoint-tool dtensor-check plan-quality collectives-bench dtensor-bench; do
  [ -x "$bin/$p" ] || fail "program $p not installed in $bindir"
done
if grep -rlF -e "$src" -e "$build" "$inc" "$lib/pkgconfig" "$lib/cmake" >"$tmp/leaks"; then
  cat "$tmp/leaks"; fail "installed files name the source or build tree"
fi

# One translation unit including every installed header, next to the program.
sed 's|.*|#include "&"|' "$tmp/got" >"$tmp/all_headers.cpp"
# The out-of-tree trainer of examples/custom-trainer, copied alone: it sees only the prefix.
cp "$src/examples/custom-trainer/trainer.cpp" "$src/examples/custom-trainer/CMakeLists.txt" \
   "$src/examples/custom-trainer/meson.build" "$tmp/"
cd "$tmp"
expect() {  # expect OUTPUT_FILE: the trainer resumed from its checkpoint with the same losses
  grep -q '^custom-trainer: ok$' "$1" || { cat "$1"; fail "the custom trainer did not reproduce its losses"; }
}

# pkg-config (the .pc is relocatable: its prefix is found from its own place): every installed
# header in one translation unit with only its --cflags, then the program built by a meson
# project, as a user's out-of-tree trainer would be.
export PKG_CONFIG_PATH=$lib/pkgconfig
cflags=$(pkg-config --cflags dtensor-runtime) && pkg-config --libs dtensor-runtime >/dev/null \
  || fail "pkg-config cannot resolve dtensor-runtime"
# shellcheck disable=SC2086  # the flags are words
c++ -std=c++20 -fsyntax-only all_headers.cpp $cflags 2>compile.log \
  || { cat compile.log; echo "cflags: $cflags"; fail "the installed headers do not compile with pkg-config's flags alone"; }
meson setup meson-build >meson.log 2>&1 && ninja -C meson-build >>meson.log 2>&1 \
  || { cat meson.log; fail "building against the installed prefix with meson and pkg-config failed"; }
meson-build/custom-trainer local ckpt-pc >run-pc.txt 2>&1 \
  || { cat run-pc.txt; fail "the meson (pkg-config) build did not run"; }
expect run-pc.txt

# CMake.
cmake -S . -B cmake-build -DCMAKE_PREFIX_PATH="$root" -DCMAKE_BUILD_TYPE=Release >cmake.log 2>&1 \
  || { cat cmake.log; fail "cmake could not configure against the installed prefix"; }
cmake --build cmake-build >>cmake.log 2>&1 || { cat cmake.log; fail "building against the installed prefix with CMake failed"; }
cmake-build/custom-trainer local ckpt-cmake >run-cmake.txt 2>&1 \
  || { cat run-cmake.txt; fail "the CMake build did not run"; }
expect run-cmake.txt

# Under mpirun, 4 processes, when the build has MPI.
runs="local (meson, CMake)"
if grep -q '^mpi=true' "$build/features.txt" && command -v mpirun >/dev/null; then
  timeout 300 mpirun --allow-run-as-root --oversubscribe -np 4 cmake-build/custom-trainer mpi ckpt-mpi >run-mpi.txt 2>&1 \
    || { cat run-mpi.txt; fail "the custom trainer under mpirun -np 4 failed"; }
  expect run-mpi.txt
  runs="$runs, mpirun -np 4"
fi
echo "install-check: $(wc -l <"$tmp/got") headers, libdtensor-runtime.a; examples/custom-trainer built with meson/pkg-config and CMake, ran: $runs"
