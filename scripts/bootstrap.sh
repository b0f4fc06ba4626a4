#!/usr/bin/env bash
# Creates or refreshes .venv with every pinned dependency and builds the native module.
# Idempotent: each stage leaves a stamp keyed by its inputs, so a second call returns in seconds.
# `--deps-only` stops before the native core (docker/Dockerfile installs the dependencies in a layer
# of their own, before the sources are copied in).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
py=${PYTHON:-python3}
horovod_version=0.28.1
tfs_api_version=2.15.1
# Built wheels are kept outside the clone, keyed by every pin that changes the binary.
wheel_cache=${SHARDREC_WHEEL_CACHE:-$HOME/.cache/shardrec/wheels}
log() { printf '[bootstrap] %s\n' "$*" >&2; }

req_hash=$( (cat "$root/scripts/requirements.txt"; echo "horovod==$horovod_version tfs-api==$tfs_api_version") | sha256sum | cut -c1-16)
# The machine-wide pip config names index folders that may be missing; their warnings are noise.
pip_() { "$vpy" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"

if [ "$(cat "$venv/.deps-stamp" 2>/dev/null)" != "$req_hash" ]; then
  log "installing pinned dependencies (first run: about 5 minutes)"
  pip_ install -q --upgrade "pip==25.2"
  pip_ install -q -r "$root/scripts/requirements.txt"
  # TF Serving's API protos, for the tests of shardrec-serve's responses; --no-deps: it names the
  # full tensorflow package, whose modules tensorflow-cpu provides.
  pip_ install -q --no-deps "tensorflow-serving-api==$tfs_api_version"
  # "-origin": wheels whose RUNPATH is relative to the installed package (relocate_wheel.py); a
  # wheel cached before that names its builder's venv and is not reused.
  hvd_key="horovod-$horovod_version-$("$vpy" -c 'import tensorflow as t, mpi4py, sys; print(f"tf{t.__version__}-mpi4py{mpi4py.__version__}-py{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null)-origin"
  hvd_dir="$wheel_cache/$hvd_key"
  if ! ls "$hvd_dir"/horovod-*.whl >/dev/null 2>&1; then
    log "building horovod $horovod_version from source with TensorFlow and MPI (about 3 minutes)"
    mkdir -p "$hvd_dir.tmp"
    PATH="$venv/bin:$PATH" HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
      HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2 \
      pip_ wheel -q --no-deps --no-build-isolation --no-cache-dir \
      -w "$hvd_dir.tmp" "horovod==$horovod_version"
    # The build's RUNPATH names this venv's lib (libmpi): made relative, so that the cached wheel
    # works in every clone, also once this one is gone.
    "$vpy" "$root/scripts/relocate_wheel.py" --venv "$venv" "$hvd_dir.tmp"/horovod-*.whl
    rm -rf "$hvd_dir" && mv "$hvd_dir.tmp" "$hvd_dir"
  else
    log "reusing cached horovod wheel from $hvd_dir"
  fi
  pip_ install -q --no-deps --force-reinstall "$hvd_dir"/horovod-*.whl
  "$vpy" -c 'import horovod.tensorflow as hvd; assert hvd.mpi_built(), "horovod was built without MPI"'
  echo "$req_hash" > "$venv/.deps-stamp"
  rm -f "$venv/.native-stamp"
fi

# The message broker that stream training reads from (Redis Streams), from Debian's packages: the
# tests and the stream demo start their own server on a localhost port and stop it.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian's redis-server (the stream tests' and demo's broker)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    log "redis-server is not installed and this is not a root Debian machine: the broker tests and stream demo" \
        "need it (as root: apt-get install redis-server)"
  fi
fi

[ "${1:-}" = "--deps-only" ] && exit 0

# The native module: rebuilt whenever a source or build file changed.
# Every source under native/src (its rooms), named and in a fixed order, so that a file moved or
# renamed rebuilds too.
native_hash=$( (cd "$root" && find native/src -type f | LC_ALL=C sort | while read -r f; do echo "$f"; cat "$f"; done;
  cat setup.py pyproject.toml) 2>/dev/null | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.native-stamp" 2>/dev/null)" != "$native_hash" ]; then
  log "building the native core"
  PATH="$venv/bin:$PATH" pip_ install -q --no-deps --no-build-isolation --config-settings editable_mode=lenient -e "$root"
  echo "$native_hash" > "$venv/.native-stamp"
fi
