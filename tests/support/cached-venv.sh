# Sourced by the scripts that build a cached venv under ~/.cache/kvoffload (tests/engine/build-venv.sh,
# tests/routing/build-router.sh). cached_venv_begin DEST: print DEST and exit when a finished build is there
# (DEST/.done); else take DEST.lock (a second caller waits for the first build instead of racing it), look
# again, and start over from an empty DEST (a broken half-install is rebuilt).
CACHE=${KVO_CACHE:-$HOME/.cache/kvoffload}
cached_venv_begin() {
  local dest=$1
  if [ -f "$dest/.done" ]; then echo "$dest"; exit 0; fi
  mkdir -p "$CACHE"
  exec 9>"$dest.lock"
  flock 9
  if [ -f "$dest/.done" ]; then echo "$dest"; exit 0; fi
  rm -rf "$dest"
}
