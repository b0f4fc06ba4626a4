#!/usr/bin/env bash
# Builds shardrec's image here with podman on a Debian base made locally (no registry needed) and
# proves it: no compiler and a non-root user in the runtime image; the quick test subset inside it;
# the main job on 2 ranks writing its checkpoint to a host directory; a second container restoring
# that checkpoint and continuing from its step; two containers as two hosts (each its own network
# namespace, mpiexec reaching the second over ssh) whose tables equal the single-host run's (abs 1e-5);
# docker/compose.yaml run with podman-compose, a worker's rank killed mid-run and the job restarted
# by the supervisor from its checkpoint, then continued by a second `up`; last its elastic variant
# (docker/compose.elastic.yaml): worker-2's container stopped, the job goes on with 1 rank on
# worker-1; started again, the job grows back to 2 ranks and ends at its last step.
#
#   sudo bash docker/test-image.sh          (root: podman rootful, network namespaces)
#
# Environment: SHARDREC_PODMAN_STORE (default /var/tmp/shardrec-podman) keeps podman's images, so a
# second run reuses the base and the build's layers; SHARDREC_IMAGE (default localhost/shardrec:test);
# KEEP=1 keeps the work directory. Containers, compose volumes, network namespaces and the work
# directory are removed at the end, whatever happened; built images stay cached.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
store=${SHARDREC_PODMAN_STORE:-/var/tmp/shardrec-podman}
image=${SHARDREC_IMAGE:-localhost/shardrec:test}
base=localhost/shardrec-bookworm-base:latest
tag="sr$$"
work=$(mktemp -d /tmp/shardrec-image-test.XXXXXX)
started=$(date +%s)
log() { printf '[test-image %4ds] %s\n' "$(( $(date +%s) - started ))" "$*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
pm() { podman --root "$store/root" --runroot "$store/runroot" --storage-driver overlay "$@"; }
# Limits podman's defaults exceed on this kind of machine, and runc (crun fails on its mixed cgroups).
run_flags=(--runtime runc --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 --shm-size 512m)
compose_files=(-f "$root/docker/compose.yaml")
compose() {
  SHARDREC_IMAGE="$image" "$work/compose-venv/bin/podman-compose" -p "$tag" "${compose_files[@]}" \
    --podman-args "--root $store/root --runroot $store/runroot --storage-driver overlay --runtime runc" "$@"
}

cleanup() {
  local code=$?
  set +e
  [ -x "$work/compose-venv/bin/podman-compose" ] && compose down -v -t 0 >/dev/null 2>&1
  for c in $(pm ps -a --format '{{.Names}}' 2>/dev/null | grep -E "^$tag[-_]"); do pm rm -f -t 0 "$c" >/dev/null 2>&1; done
  for ns in "$tag-h1" "$tag-h2"; do ip netns del "$ns" 2>/dev/null; done
  [ "${KEEP:-0}" = 1 ] && log "work directory kept: $work" || rm -rf "$work"
  [ $code -eq 0 ] && log "PASSED in $(( $(date +%s) - started )) s" || log "exit $code after $(( $(date +%s) - started )) s"
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # so that an interrupted run cleans up too

[ "$(id -u)" = 0 ] || fail "run as root (podman rootful and network namespaces): sudo bash $0"
missing=()
for tool in podman debootstrap runc ip unshare; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing podman, buildah, debootstrap, runc, iproute2 (missing: ${missing[*]})"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah debootstrap runc iproute2 >/dev/null \
    || fail "apt-get could not install podman buildah debootstrap runc iproute2"
fi
mkdir -p "$store"

# 1. The base: a minimal Debian made here (no registry to pull one from).
if ! pm image exists "$base"; then
  # The mirror this machine's apt uses (deb.debian.org where none is configured).
  mirror=$(apt-cache policy 2>/dev/null | awk '$3 == "bookworm/main" {print $2; exit}')
  log "making the Debian bookworm base with debootstrap from ${mirror:-http://deb.debian.org/debian}"
  debootstrap --variant=minbase bookworm "$work/rootfs" "${mirror:-http://deb.debian.org/debian}" > "$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log"; fail "debootstrap"; }
  tar -C "$work/rootfs" -c . | pm import - "$base" >/dev/null
  rm -rf "$work/rootfs"
fi

# 2. The image, from docker/Dockerfile as users build it, with the base as its build argument.
log "building $image (first time: about 5 minutes on 2 cores; later builds reuse the layers)"
secret=()
[ -s /etc/ssl/certs/ca-certificates.crt ] && secret=(--secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt)
# The builder stage gets a tag of its own so that pruning what earlier builds left (below) keeps its
# layers for the next build.
for target in builder runtime; do
  name=$image; [ $target = builder ] && name=$image-builder
  pm build --network=host --runtime runc -f "$root/docker/Dockerfile" --build-arg BASE_IMAGE="$base" "${secret[@]}" \
    --target $target -t "$name" "$root" >> "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "podman build"; }
done
# Each build of a changed tree leaves its predecessor's 1.8 GB behind, untagged: remove those.
pm image prune -f > /dev/null
log "built: $(pm image inspect --format '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1/1e9}')"
run() { pm run --rm "${run_flags[@]}" "$@"; }
# The hosts every rank of every attempt under checkpoint directory $1 beat from (their heartbeats).
hosts_of() { cat "$1"/runs/*/attempt-*/heartbeat/rank-*.json | grep -o '"host": "[^"]*"' | sort -u | tr '\n' ' '; }

# 3. The runtime image: a non-root user, and nothing that compiles.
user=$(pm image inspect --format '{{.Config.User}}' "$image")
uid=$(run "$image" id -u)
[ "$user" = shardrec ] && [ "$uid" != 0 ] || fail "the image runs as '$user' (uid $uid): expected the non-root user shardrec"
compilers=$(run "$image" sh -c 'cd /tmp && printf "int main(void){return 0;}\n" > t.c &&
  for cc in cc gcc c++ g++ clang clang++ tcc mpicc mpicxx x86_64-linux-gnu-gcc-12; do
    "$cc" t.c -o t.out >/dev/null 2>&1 && echo "$cc"; done; true')
[ -z "$compilers" ] || fail "the runtime image compiles C with: $compilers"
# (gcc-12-base is not one: it is the runtime library's documentation, which libgcc-s1 depends on.)
packages=$(run "$image" sh -c "dpkg-query -W -f '\${Package} \${Status}\n' 2>/dev/null | grep 'install ok installed' |
  cut -d' ' -f1 | grep -E '^(gcc|g\+\+|cpp|clang|tcc|binutils)(-[0-9.]+)?$|^binutils-|^clang-' || true")
[ -z "$packages" ] || fail "compiler packages in the runtime image: $packages"
log "runtime image: user shardrec (uid $uid), no compiler, no compiler package"

# 4. The test command's quick subset, inside the image, as its user.
log "quick tests inside the image (pytest -m quick)"
run --workdir /opt/shardrec "$image" python -m pytest -p no:cacheprovider -m quick -q --durations=8 > "$work/quick.log" 2>&1 \
  || { tail -40 "$work/quick.log"; fail "quick tests inside the image"; }
log "quick tests: $(tail -1 "$work/quick.log")"

# 5. The main job on 2 ranks, checkpoint in a host directory; 6. a second container continues it.
demo_args="--batch-size 256 --eval-samples 4096 --log-every 30"
install -d -o 1000 -g 1000 "$work/single" "$work/two-hosts" "$work/ssh"
log "run 1: 2 ranks to step 60, checkpoint in $work/single"
run -v "$work/single:/checkpoints" -e SHARDREC_DEMO_ARGS="--steps 60 --save-every 30 $demo_args" "$image" demo \
  > "$work/run1.log" 2>&1 || { tail -30 "$work/run1.log"; fail "run 1"; }
[ -f "$work/single/model-60.index" ] && [ -d "$work/single/sparse-model-60/rank-1-of-2" ] \
  || fail "run 1 left no checkpoint model-60 in the host directory: $(ls "$work/single")"
log "run 2: a new container restores step 60 and trains to step 120"
run -v "$work/single:/checkpoints" -e SHARDREC_DEMO_ARGS="--steps 120 $demo_args" "$image" demo \
  > "$work/run2.log" 2>&1 || { tail -30 "$work/run2.log"; fail "run 2"; }
grep -q "resumed from /checkpoints/model-60: continuing at step 61 of 120" "$work/run2.log" \
  || { tail -30 "$work/run2.log"; fail "run 2 did not resume from the checkpoint of step 60"; }
grep -q "SUMMARY rank=0/2 steps=120 resumed_from=60" "$work/run2.log" || fail "run 2 did not end at step 120"

# 7. Two containers as two hosts: each in a network namespace of its own (a veth pair between
# them), mpiexec in the first starting the second's rank through its sshd, the checkpoint directory
# shared by both (as a volume on a cluster).
log "run 3: 2 containers as 2 hosts, 1 rank each, from step 0 to 120"
subnet="10.$(( 80 + $$ % 100 )).0"
ip netns add "$tag-h1" && ip netns add "$tag-h2"
ip link add "$tag-a" type veth peer name "$tag-b"
ip link set "$tag-a" netns "$tag-h1" && ip link set "$tag-b" netns "$tag-h2"
ip -n "$tag-h1" addr add "$subnet.1/24" dev "$tag-a" && ip -n "$tag-h2" addr add "$subnet.2/24" dev "$tag-b"
for h in h1 h2; do ip -n "$tag-$h" link set lo up; done
ip -n "$tag-h1" link set "$tag-a" up && ip -n "$tag-h2" link set "$tag-b" up
hosts=(--add-host "$tag-h1:$subnet.1" --add-host "$tag-h2:$subnet.2")
shared=(-v "$work/two-hosts:/checkpoints" -v "$work/ssh:/home/shardrec/.ssh")
pm run -d --name "$tag-h2" "${run_flags[@]}" --network "ns:/run/netns/$tag-h2" --hostname "$tag-h2" "${hosts[@]}" \
  "${shared[@]}" "$image" sshd >/dev/null
run --name "$tag-h1" --network "ns:/run/netns/$tag-h1" --hostname "$tag-h1" "${hosts[@]}" "${shared[@]}" \
  -e SHARDREC_DEMO_ARGS="--steps 120 $demo_args" "$image" demo -H "$tag-h1:1,$tag-h2:1" --max-restarts 0 \
  --mpiexec-arg=--mca --mpiexec-arg=btl_tcp_if_include --mpiexec-arg="$subnet.0/24" \
  --mpiexec-arg=--mca --mpiexec-arg=oob_tcp_if_include --mpiexec-arg="$subnet.0/24" \
  --mpiexec-arg=--bind-to --mpiexec-arg=none \
  > "$work/run3.log" 2>&1 || { tail -40 "$work/run3.log"; pm logs "$tag-h2" 2>&1 | tail -10; fail "run 3"; }
grep -q "SUMMARY rank=0/2 steps=120 resumed_from=0" "$work/run3.log" || fail "run 3 did not end at step 120"
hosts_seen=$(hosts_of "$work/two-hosts")
[ "$hosts_seen" = "\"host\": \"$tag-h1\" \"host\": \"$tag-h2\" " ] || fail "run 3's ranks did not run on the two hosts: $hosts_seen"
log "run 3 ranks ran on: $hosts_seen"

# 8. The two-host tables against the single-host run's, every table, values and optimizer slots.
run -i -v "$work/single:/a:ro" -v "$work/two-hosts:/b:ro" "$image" python - <<'PY' | tee "$work/compare.log" \
  || fail "the two-host run's tables differ from the single-host run's"
import numpy as np, subprocess, sys
for table in ("deep_table", "wide_table"):
    got = {}
    for d in ("/a", "/b"):
        subprocess.run(["shardrec-ckpt", "export", d, "--table", table, "--out", f"/tmp{d}-{table}.npz"], check=True)
        got[d] = np.load(f"/tmp{d}-{table}.npz", allow_pickle=False)
    a, b = got["/a"], got["/b"]
    ia, ib = np.argsort(a["keys"]), np.argsort(b["keys"])
    if not np.array_equal(a["keys"][ia], b["keys"][ib]):
        sys.exit(f"{table}: the two runs hold different keys ({len(a['keys'])} and {len(b['keys'])})")
    for name in a.files:
        diff = float(np.max(np.abs(a[name][ia].astype(np.float64) - b[name][ib]))) if name != "keys" else 0.0
        print(f"{table} {name}: {len(ia)} rows, max |single host - two hosts| = {diff:.3g}")
        if diff > 1e-5:
            sys.exit(f"{table} {name} differs by {diff} (> 1e-5)")
print("compared", flush=True)
PY
# The comparison must have run (a script that reads no input would pass silently).
grep -q "^compared$" "$work/compare.log" || fail "the table comparison did not run"
log "two-host tables equal the single-host run's (abs 1e-5)"

# 9. docker/compose.yaml as users run it (podman-compose from PyPI here): two sshd workers (the first
# makes the job's key), the launcher's supervised job over them, the checkpoint volume shared by all.
# Once checkpoint 20 is written, worker-2's rank is killed: the supervisor must stop the job and start
# it again from the last checkpoint. A second `up` over the same volume continues from step 200.
log "compose: docker/compose.yaml, 2 workers, to step 200 with worker-2's rank killed after step 20"
python3 -m venv "$work/compose-venv" && "$work/compose-venv/bin/pip" install -q podman-compose==1.6.0 2>/dev/null \
  || fail "pip could not install podman-compose"
# `up` in the background with its exit code read from the launcher: what `up --exit-code-from
# launcher` does in the foreground (podman-compose's attached `up` is not run in the background here).
compose_job() {  # steps log
  SHARDREC_DEMO_ARGS="$1" compose up -d > "$work/$2.up.log" 2>&1 || { tail -20 "$work/$2.up.log"; fail "compose up"; }
}
compose_wait() {  # log
  local code
  code=$(pm wait "${tag}_launcher_1")
  pm logs "${tag}_launcher_1" > "$work/$1.log" 2>&1
  [ "$code" = 0 ] || { tail -30 "$work/$1.log"; fail "the compose launcher exited $code"; }
}
compose_job "--steps 200 --save-every 20 $demo_args" compose1
volume=$(pm volume inspect --format '{{.Mountpoint}}' "${tag}_checkpoints")
for _ in $(seq 360); do
  [ -f "$volume/model-20.meta" ] && break
  [ "$(pm inspect --format '{{.State.Running}}' "${tag}_launcher_1")" = true ] || break
  sleep 0.5
done
[ -f "$volume/model-20.meta" ] || { pm logs "${tag}_launcher_1" 2>&1 | tail -30; fail "no checkpoint 20 from compose"; }
killed=$(pm exec "${tag}_worker-2_1" python -c 'import psutil
for p in psutil.process_iter(["cmdline"]):
    if any(a.endswith("examples/wide_deep.py") for a in p.info["cmdline"] or []): p.kill(); print("killed", p.pid)')
[[ "$killed" == *killed* ]] || fail "found no rank to kill in ${tag}_worker-2_1"
log "compose: killed worker-2's rank after checkpoint 20"
compose_wait compose1
grep -q -E "restarting the job in [0-9]+ s \(attempt 1 of 4\) from /checkpoints/model-[0-9]+ \(step" "$work/compose1.log" \
  && grep -q -E "SUMMARY rank=0/2 steps=200 resumed_from=[1-9][0-9]*" "$work/compose1.log" \
  || { tail -30 "$work/compose1.log"; fail "the supervisor did not restart the compose job from its checkpoint"; }
compose down -t 0 > /dev/null 2>&1  # the containers, not the volumes
compose_job "--steps 240 $demo_args" compose2
compose_wait compose2
grep -q "resumed from /checkpoints/model-200: continuing at step 201 of 240" "$work/compose2.log" \
  && grep -q "SUMMARY rank=0/2 steps=240 resumed_from=200" "$work/compose2.log" \
  || { tail -30 "$work/compose2.log"; fail "the second compose up did not continue from step 200"; }
hosts_seen=$(hosts_of "$volume")
[ "$hosts_seen" = '"host": "worker-1" "host": "worker-2" ' ] || fail "the compose job's ranks ran on: $hosts_seen"
compose down -v -t 0 > /dev/null 2>&1
log "compose: ranks on worker-1 and worker-2; restarted by the supervisor from $(grep -a -o -E 'from /checkpoints/model-[0-9]+' "$work/compose1.log" | head -1 | cut -d' ' -f2); a second up continued from step 200"

# 10. The elastic variant: docker/compose.elastic.yaml over compose.yaml, the hosts those whose sshd
# answers (the image's shardrec-discover-hosts). Once checkpoint 50 is written, worker-2's container
# is stopped: the job must go on with 1 rank on worker-1 from its last checkpoint. Once that rank has
# trained past the step it restored, worker-2 is started again: the job must grow back to 2 ranks
# (the ranks save at the end of a step) and end at its last step, every attempt in summary.json.
log "compose elastic: worker-2's container stopped after checkpoint 50, then started again"
compose_files+=(-f "$root/docker/compose.elastic.yaml")
compose_job "--steps 1000 --save-every 50 --global-batch-size 256 --eval-samples 4096 --log-every 100" elastic
volume=$(pm volume inspect --format '{{.Mountpoint}}' "${tag}_checkpoints")
# The step rank 0 of attempt $1 reported last (0 before it has).
beat_step() {
  cat "$volume"/runs/*/attempt-"$1"/heartbeat/rank-0.json 2>/dev/null | grep -o '"step": [0-9]*' | grep -o '[0-9]*$' \
    || echo 0
}
# Waits up to $1 s for the condition $2 (a shell expression) while the launcher runs; fails naming $3.
wait_until() {
  for _ in $(seq $(( $1 * 2 ))); do
    eval "$2" && return 0
    [ "$(pm inspect --format '{{.State.Running}}' "${tag}_launcher_1")" = true ] || break
    sleep 0.5
  done
  # The supervisor's own lines first (every attempt, how it ended, where it restarted from).
  # The runs directory (each attempt's rank logs and heartbeats) is copied, for KEEP=1 to keep.
  eval "$2" || { pm logs "${tag}_launcher_1" > "$work/elastic.log" 2>&1; grep -a "^\[shardrec-run" "$work/elastic.log" \
    | tail -40; tail -30 "$work/elastic.log"; cp -r "$volume/runs" "$work/runs" 2>/dev/null
    fail "compose elastic: no $3"; }
}
# A checkpoint is complete once its meta graph is there, the last file the Saver writes (after the
# index): a worker stopped between the two leaves step 50 incomplete, and the job rightly starts
# again from step 0, which is not what this step tests.
wait_until 300 '[ -f "$volume/model-50.meta" ]' "checkpoint 50"
pm stop -t 2 "${tag}_worker-2_1" > /dev/null
stopped_at=$(date +%s)
log "compose elastic: stopped worker-2's container"
wait_until 300 '[ -f "$volume"/runs/*/attempt-1/command.json ] && [ "$(beat_step 1)" -gt 50 ]' \
  "training on worker-1 alone after worker-2 stopped"
shrunk_in=$(( $(date +%s) - stopped_at ))
pm start "${tag}_worker-2_1" > /dev/null
started_at=$(date +%s)
log "compose elastic: training on 1 rank $shrunk_in s after the stop; started worker-2's container again"
wait_until 300 '[ -f "$volume"/runs/*/attempt-2/command.json ] && [ "$(beat_step 2)" -gt "$(beat_step 1)" ]' \
  "growth back to 2 ranks once worker-2 answered again"
grown_in=$(( $(date +%s) - started_at ))
compose_wait elastic
python3 - "$volume" "$work/elastic.log" <<'PY' || { grep -a "^\[shardrec-run" "$work/elastic.log" | tail -40; fail "compose elastic: the job's attempts"; }
import glob, json, re, sys
volume, log = sys.argv[1:]
(summary,) = glob.glob(f"{volume}/runs/*/summary.json")
attempts = json.load(open(summary))["attempt_list"]
seen = [(a["np"], a["hosts"], a["reason"]) for a in attempts]
print("attempts:", seen)
assert [a["np"] for a in attempts] == [2, 1, 2], seen
assert attempts[0]["hosts"] == "worker-1:1,worker-2:1" and attempts[0]["host"] == "worker-2", attempts[0]
assert attempts[1]["hosts"] == "worker-1:1" and attempts[1]["reason"] == "resized", attempts[1]
assert attempts[1]["resumed_from"], f"attempt 1 was handed no checkpoint: {attempts[1]}"
restored = int(attempts[1]["resumed_from"].rsplit("-", 1)[1])
assert attempts[1]["reached_step"] > restored >= 50 and attempts[1]["steps_lost"] == 0, attempts[1]
assert attempts[2]["resumed_from"].endswith(f"model-{attempts[1]['reached_step']}"), attempts[2]
assert attempts[2]["hosts"] == "worker-1:1,worker-2:1" and attempts[2]["ok"], attempts[2]
text = open(log).read()
# The failure names the host lost; it cools down; the growth is said; the job ends on 2 ranks.
assert re.search(r"attempt 0 failed: .*worker-2", text), "the failure does not name worker-2"
assert "host worker-2 stays out of new attempts" in text and "growing from 1 to 2 rank(s)" in text
assert "SUMMARY rank=0/2 steps=1000" in text
print("checked", flush=True)
PY
compose down -v -t 0 > /dev/null 2>&1
log "compose elastic: worker-2 stopped -> training on worker-1 alone in $shrunk_in s; started again -> training on 2 ranks in $grown_in s; ended at step 1000"
