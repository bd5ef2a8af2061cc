# Sourced by tools/setup.sh and tools/sanitizers.sh: ccache settings for every build tree.
# Meson puts ccache in front of the compilers when it finds it on PATH; these make its hits
# independent of where the clone lives (CI clones afresh each run): paths under the clone are
# hashed relative to it, and the build directory is not hashed into -g objects.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export CCACHE_NOHASHDIR=true
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
