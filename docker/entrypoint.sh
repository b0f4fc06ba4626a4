#!/bin/sh
# The image's entrypoint. Its first word chooses the role:
#   demo [ARGS...]          the main job (examples/wide_deep.py) under shardrec-run on $SHARDREC_NP ranks
#                           (default 2) of this container, checkpoints in $SHARDREC_CHECKPOINT_DIR
#                           (default /checkpoints), resumed from there when it holds one; ARGS go to
#                           shardrec-run before the job (e.g. -H worker-1:1,worker-2:1 --max-restarts 2)
#   shardrec-run ARGS...    the supervisor, as on a host
#   rank COMMAND...         one process without a launcher (a single rank), e.g. rank python train.py
#   sshd                    a worker: an ssh server on port 2222, run by the training user, through
#                           which another container's mpiexec starts this one's ranks (the job's key
#                           in ~/.ssh is made by the first worker when that volume has none)
#   anything else           run as given (bash, python, shardrec-ckpt inspect /checkpoints, ...)
set -eu
home=/home/shardrec

# Waits until every other host named by -H / --hostfile in the arguments answers on the ssh port, at most
# $SHARDREC_WAIT_FOR_HOSTS_S seconds (default 120): workers start in any order (compose, Kubernetes).
wait_for_hosts() {
  python - "$@" <<'PY'
import os, socket, sys, time
from shardrec.launch.run_cli import host_names
args = sys.argv[1:]
given = {flag: value for flag, value in zip(args, args[1:]) if flag in ("-H", "--host", "--hostfile")}
hosts = [name for name, _ in host_names(given.get("-H") or given.get("--host"), given.get("--hostfile"))]
deadline = time.monotonic() + float(os.environ.get("SHARDREC_WAIT_FOR_HOSTS_S", "120"))
me = socket.gethostname().split(".")[0]
for host in [h for h in hosts if h.split(".")[0] != me]:  # this host's ranks start without ssh
    while True:
        try:
            socket.create_connection((host, 2222), timeout=2).close()
            break
        except OSError as e:
            if time.monotonic() > deadline:
                sys.exit(f"shardrec-entrypoint: host {host} does not answer on port 2222 ({e}); is its sshd worker up?")
            time.sleep(1)
PY
}

# The job's ssh key in ~/.ssh, a volume every container of the job mounts: kept when there (the MPI
# Operator mounts its own), else made by the first worker to get the lock while the others wait.
# authorized_keys is written last: once it is there, the key is complete.
job_key() {
  ssh=$home/.ssh
  [ -s "$ssh/authorized_keys" ] && return 0
  if mkdir "$ssh/.keygen-lock" 2>/dev/null; then
    rm -f "$ssh/id_ed25519" "$ssh/id_ed25519.pub"
    ssh-keygen -q -t ed25519 -N "" -C shardrec-job -f "$ssh/id_ed25519"
    cp "$ssh/id_ed25519.pub" "$ssh/authorized_keys.tmp" && mv "$ssh/authorized_keys.tmp" "$ssh/authorized_keys"
    return 0
  fi
  waited=0
  until [ -s "$ssh/authorized_keys" ]; do
    [ $waited -ge 60 ] && { echo "shardrec-entrypoint: no job key in $ssh after 60 s while another worker holds" \
      "$ssh/.keygen-lock; if no worker is making it, remove that directory" >&2; exit 1; }
    sleep 1; waited=$((waited + 1))
  done
}

case "${1:-demo}" in
  demo)
    [ $# -gt 0 ] && shift
    wait_for_hosts "$@"
    ckpt=${SHARDREC_CHECKPOINT_DIR:-/checkpoints}
    exec shardrec-run -np "${SHARDREC_NP:-2}" --checkpoint-dir "$ckpt" --run-dir "$ckpt/runs/$(date +%Y%m%d-%H%M%S)-$$" \
      "$@" -- python /opt/shardrec/examples/wide_deep.py --model-dir "$ckpt" ${SHARDREC_DEMO_ARGS:---save-every 100}
    ;;
  rank)
    shift
    exec "$@"
    ;;
  sshd)
    job_key
    mkdir -p "$home/.sshd"
    [ -s "$home/.sshd/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$home/.sshd/host_ed25519"
    exec /usr/sbin/sshd -D -e -f /etc/shardrec/sshd_config
    ;;
  *)
    exec "$@"
    ;;
esac
