# Sourced by the scripts that build binaries into the cache under ~/.cache/kvoffload
# (tests/cluster/build.sh, tests/autoscaling/build-keda.sh, tests/gitops/flux/build.sh, tests/cluster/build-node.sh):
# the lock/cache preamble they shared. cached-venv.sh is its counterpart for venvs (a .done marker instead of binaries).
#   cached_build_lock NAME  take $CACHE/NAME.lock on fd 9 for the rest of the script: a second builder waits
#                           for the first instead of building into the same work dir (kvtest.background waits on
#                           the same lock files).
#   cached_built FILE...    true when every FILE is executable: each build moves its binaries in last, so they
#                           are its done-marker.
CACHE="${KVO_CACHE:-$HOME/.cache/kvoffload}"
cached_build_lock() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/$1.lock"
  flock 9
}
cached_built() {
  local f
  for f in "$@"; do [ -x "$f" ] || return 1; done
}
