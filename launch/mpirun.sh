#!/usr/bin/env bash
# Plain mpirun launch, for users who call Open MPI themselves (no supervisor: no restarts, no hang
# detection). Usage:  launch/mpirun.sh N [HOSTFILE] -- COMMAND...
#   launch/mpirun.sh 2 -- python examples/wide_deep.py
#   launch/mpirun.sh 4 launch/hostfile.example -- python train.py
# Environment: SHARDREC_FORWARD="VAR1 VAR2" forwards more variables to remote ranks;
# SHARDREC_BIND=core pins each rank to a core (only when ranks <= cores); SHARDREC_LAUNCHER_HANG_S
# (default 30): how long mpiexec may outlive every rank it started on this host before it is killed.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
np=${1:?usage: launch/mpirun.sh N [HOSTFILE] -- COMMAND...}
shift
hostfile=()
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then
  [ -r "$1" ] || { echo "launch/mpirun.sh: hostfile $1 cannot be read" >&2; exit 2; }
  hostfile=(--hostfile "$1")
  shift
fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "launch/mpirun.sh: no COMMAND after --" >&2; exit 2; }
hang_s=${SHARDREC_LAUNCHER_HANG_S:-30}
[[ "$hang_s" =~ ^[0-9]+$ ]] && [ "$hang_s" -gt 0 ] || {
  echo "launch/mpirun.sh: SHARDREC_LAUNCHER_HANG_S=$hang_s: give a whole number of seconds > 0, or leave it unset for 30" >&2
  exit 2
}
mpiexec="$here/.venv/bin/mpiexec"
[ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec)
# Open MPI refuses root without these; containers run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# MPI's waits yield their core to the rank's other threads (rank_runtime/process/host_defaults.py says why);
# mpiexec passes OMPI_MCA_* variables to the ranks on every host.
export OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}"
args=(-np "$np" "${hostfile[@]}")
# One host: as many ranks as asked, whatever its cores (shardrec's init() then shares the cores).
[ ${#hostfile[@]} -eq 0 ] && args+=(--oversubscribe)
[ -n "${SHARDREC_BIND:-}" ] && args+=(--bind-to "$SHARDREC_BIND")
for var in PATH PYTHONPATH LD_LIBRARY_PATH TF_CPP_MIN_LOG_LEVEL SHARDREC_EXCHANGE_TIMEOUT_S ${SHARDREC_FORWARD:-}; do
  [ -n "${!var+x}" ] && args+=(-x "$var")
done
# Open MPI's session files go to a directory of this launch's own, removed at the end: a job killed
# hard leaves its rendezvous files behind, and a later mpiexec that gets the same PID (they are
# reused) then cannot start ("The PMIx server's listener thread failed to start").
tmp=$(mktemp -d "${TMPDIR:-/tmp}/shardrec-mpi-XXXXXX")
watcher=""
trap 'rm -rf "$tmp"; [ -z "$watcher" ] || kill "$watcher" 2>/dev/null' EXIT
TMPDIR="$tmp" "$mpiexec" "${args[@]}" "$@" <&0 &
child=$!

# Open MPI 5.0.11's launcher can deadlock as it ends a job (a peer connecting to it at that moment,
# docs/guide/launching.md): its ranks ended and left unreaped, it never exits and ignores SIGTERM.
# Once every process it started on this host has ended for $hang_s s while it still runs, it is
# SIGKILLed and the launch fails saying so. A launcher with remote hosts keeps its ssh children, so
# this never fires on one that still waits for them.
watch_launcher() {
  local seen=0 since="" stats
  while kill -0 "$child" 2>/dev/null; do
    stats=$(ps -o stat= --ppid "$child") || true  # ps fails when it lists none
    # A rank seen once, even only as a zombie (one that ended within a poll is still listed so);
    # then none listed (reaped) or only zombies is every rank ended.
    [ -z "$stats" ] || seen=1
    if [ -n "$stats" ] && grep -qv '^Z' <<<"$stats"; then
      since=""
    elif [ "$seen" = 1 ]; then
      since=${since:-$SECONDS}
      if (( SECONDS - since >= hang_s )); then
        echo "launch/mpirun.sh: mpiexec (pid $child) still runs $hang_s s after every rank it started here ended" \
             "(Open MPI's launcher deadlocked ending the job, docs/guide/launching.md); killing it, the launch fails" \
             "(SHARDREC_LAUNCHER_HANG_S)" >&2
        : > "$tmp/launcher-hung"
        kill -KILL "$child"
        return
      fi
    fi
    sleep 0.5
  done
}
watch_launcher &
watcher=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT HUP
set +e
wait "$child"
code=$?
# A trapped signal ends `wait` early: wait for mpiexec itself to finish stopping the ranks.
while kill -0 "$child" 2>/dev/null; do
  wait "$child"
  code=$?
done
[ -e "$tmp/launcher-hung" ] && code=1
exit "$code"
