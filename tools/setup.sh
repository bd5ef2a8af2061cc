#!/usr/bin/env bash
# Installs the Debian packages the project needs (only those missing), then configures and builds.
# Idempotent and quiet when everything is already there.
#   tools/setup.sh [BUILD_DIR] [meson setup options...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

packages=(meson ninja-build pkg-config g++ python3 libeigen3-dev libfmt-dev catch2 libcli11-dev
          nlohmann-json3-dev libboost-dev libopenmpi-dev openmpi-bin python3-matplotlib libxxhash-dev
          clang libclang-rt-dev  # clang + its runtime: the libFuzzer tree (tools/sanitizers.sh)
          ccache                 # meson wraps the compilers in it: a second build of the same sources is a cache hit
          cmake)                 # the install check builds against the installed prefix with find_package
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq >/dev/null
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

source tools/ccache_env.sh
build=${1:-build}; shift || true
if [ ! -f "$build/build.ninja" ]; then
  echo "setup: configuring $build $*"
  meson setup "$build" --buildtype=release "$@" >"$build.setup.log" 2>&1 \
    || { cat "$build.setup.log"; exit 1; }
  rm -f "$build.setup.log"
fi
ninja -C "$build" --quiet >/dev/null 2>"$build.ninja.log" || { cat "$build.ninja.log"; ninja -C "$build"; exit 1; }
rm -f "$build.ninja.log"
