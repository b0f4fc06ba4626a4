"""The demo across two "hosts" over TCP against the same two ranks on one host: samples/s.

    sudo python bench/two_hosts.py [--rounds 3] [--steps 300]      (root: it makes network namespaces)

The hosts are two network namespaces of this machine joined by a veth pair (tests/netns_hosts.py),
Open MPI's TCP kept on their link. Both runs use `--bind-to none`: each namespace "host" believes it
owns every core, so Open MPI's default binding would put both ranks on core 0 and measure that
(RECIPES.md). The runs alternate; the last line is JSON with the medians and their ratio.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from netns_hosts import NetnsHosts  # noqa: E402

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
# Each namespace "host" holds one rank and sees every core, so init() would give each rank's
# TensorFlow a thread per core; the two ranks share this machine's cores as two ranks on one host
# do, so both runs get the pools init() gives ranks that share a host.
SHARED = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PYTHONUNBUFFERED="1", **SHARED)


def demo(prefix, mpiexec_args, steps, model_dir):
    cmd = prefix + [MPIEXEC, "-np", "2", *mpiexec_args, "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "PATH",
                    *[a for name in SHARED for a in ("-x", name)],
                    sys.executable, os.path.join(ROOT, "examples", "wide_deep.py"), "--steps", str(steps),
                    "--eval-samples", "4096", "--model-dir", model_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    rates = [float(m) for m in re.findall(r"samples_per_s=(\d+)", proc.stdout)]
    if proc.returncode != 0 or not rates:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return statistics.median(rates)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="shardrec-two-hosts-")
    hosts = NetnsHosts(os.path.join(work, "hosts"))
    one, two = [], []
    try:
        across = ["--hostfile", hosts.hostfile(work), *hosts.mpiexec_args()]
        for i in range(args.rounds):
            one.append(demo([], ["--bind-to", "none"], args.steps, os.path.join(work, f"one-{i}")))
            two.append(demo(hosts.inside(0, []), across, args.steps, os.path.join(work, f"two-{i}")))
            print(f"round {i + 1}: one host {one[-1]:.0f} samples/s, two hosts {two[-1]:.0f}", file=sys.stderr,
                  flush=True)
    finally:
        hosts.close()
        subprocess.run(["rm", "-rf", work])
    ratio = statistics.median(two) / statistics.median(one)
    print(json.dumps({"one_host": statistics.median(one), "two_hosts": statistics.median(two), "ratio": ratio,
                      "rounds": list(zip(one, two)), "steps": args.steps}))


if __name__ == "__main__":
    main()
