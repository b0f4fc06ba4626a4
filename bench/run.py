"""Runs every benchmark of bench/ in one go and compares shardrec with its peers in the same run.

    python bench/run.py [--short] [--out bench/results.json]

Each measurement runs in a process of its own (peers never share a TensorFlow runtime), repeated
and reported as the median; ratios are shardrec / peer from the same run. Machine, command and
versions are written next to the figures.
"""
import argparse
import datetime
import json
import mmap
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PYTHONUNBUFFERED="1")


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


SINGLE_RANK_PEERS = ("shardrec", "tf_premapped", "tf_premapped_ds", "tf_hash_table", "tfra")
PEER_NOTES = {
    "tf_premapped": "ids pre-mapped to rows outside the graph; lazy Adam's dedup in the step, SGD without dedup",
    "tf_premapped_ds": "as tf_premapped, lazy Adam's dedup in the dataset map with prefetch(4), as shardrec's",
    "tf_hash_table": "DenseHashTable key->row, one dedup, one lookup, pre-sized",
    "tfra": "embedding_lookup_unique, init_size like shardrec's capacity",
}

# What shardrec's init() gives ranks that share the cores, given to every multi-rank peer alike.
SHARED_CORES = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "HOROVOD_CYCLE_TIME": "0.2"}


def run(cmd, ranks=1, timeout=900, bind_to_core=False, env=None):
    """`env`: variables added to the benchmark's own (ENV)."""
    env = dict(ENV, **(env or {}))
    if bind_to_core:
        # A core per rank, nothing shared: at most as many ranks as cores.
        cmd = [MPIEXEC, "--bind-to", "core", "-np", str(ranks)] + cmd
        env = dict(env, **SHARED_CORES)
    elif ranks > 1:
        cmd = [MPIEXEC, "--oversubscribe", "-np", str(ranks)] + cmd
        env = dict(env, **SHARED_CORES)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def json_line(stdout):
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def peer_available(peer):
    if not peer.startswith("tfra"):
        return True
    try:
        import importlib.util

        return importlib.util.find_spec("tensorflow_recommenders_addons") is not None
    except ImportError:
        return False


def fewer_steps(peer, dim, short):
    """TFRA's dim-128 steps take 0.3-0.6 s each here: half the timed steps keep `make bench` under
    20 minutes; 4 windows of 4 steps still give a median."""
    return ["--steps", "16", "--warmup", "3"] if peer.startswith("tfra") and dim == 128 and not short else []


def _spread(outs):
    """A figure's spread: the lowest and highest window of every run of it."""
    windows = [w for out in outs for w in out["windows"]]
    return min(windows), max(windows)


def _step_note(note, outs, peer_outs, feed):
    """The note of a sparse-step row: the peer, the feed, the workload's distinct ids per batch, and
    the spread of both figures and of the ratio over the rounds (each round ran both in turn)."""
    lo, hi = _spread(outs)
    text = (f"{note}; feed: {FEEDS[feed]}; {outs[0]['distinct_per_batch'] / 1000:.1f}k distinct ids per batch; "
            f"windows of {len(outs)} round(s): shardrec {lo / 1e6:.2f}-{hi / 1e6:.2f}M")
    if peer_outs:
        plo, phi = _spread(peer_outs)
        ratios = ", ".join(f"{a['ids_per_s'] / b['ids_per_s']:.2f}" for a, b in zip(outs, peer_outs))
        text += f", peer {plo / 1e6:.2f}-{phi / 1e6:.2f}M; ratio per round {ratios}"
    return text


FEEDS = {"records": "TFRecord files parsed by tf.data (a user's path)",
         "step-only": "STEP-ONLY: batches from numpy, no parsing"}


def _step_runs(peers, dim, opt, extra, repeats, short, ranks=1):
    """{peer: [sparse_step.py JSON of each round]}, the peers interleaved in every round so that a
    slow spell of the machine hits them all alike."""
    outs = {}
    for _ in range(repeats):
        for peer in peers:
            if not peer_available(peer):
                continue
            log(f"sparse step: {peer} dim {dim} {opt}" + (f" on {ranks} ranks" if ranks > 1 else "")
                + (" (step-only feed)" if "step-only" in extra else ""))
            outs.setdefault(peer, []).append(json_line(run(
                [sys.executable, "bench/sparse_step.py", "--peer", peer, "--dim", str(dim), "--optimizer", opt]
                + extra + fewer_steps(peer, dim, short), ranks=ranks)))
    return outs


def sparse_step(short, repeats):
    """Every peer on the user's feed (records), 1 and 2 ranks; and shardrec against TFRA on the
    step-only feed once (dim 16, lazy Adam), labelled as such."""
    rows = []
    dims = [16] if short else [16, 128]
    optimizers = ["lazy_adam"] if short else ["lazy_adam", "sgd"]
    size = ["--batches", "4", "--steps", "8", "--warmup", "2", "--windows", "2"] if short else []
    for dim in dims:
        for opt in optimizers:
            samples = _step_runs(SINGLE_RANK_PEERS, dim, opt, size, repeats, short)
            two = _step_runs(("shardrec", "tfra_horovod"), dim, opt, size, repeats, short, ranks=2)
            ours = statistics.median(o["ids_per_s"] for o in samples["shardrec"])
            for peer in SINGLE_RANK_PEERS[1:]:
                if peer == "tf_premapped_ds" and opt == "sgd":
                    continue  # SGD needs no dedup: the same graph as tf_premapped
                theirs = samples.get(peer)
                rows.append({"workload": "sparse_step", "dim": dim, "optimizer": opt, "ranks": 1, "peer": peer,
                             "feed": "records", "unit": "ids/s", "shardrec": ours,
                             "peer_value": statistics.median(o["ids_per_s"] for o in theirs) if theirs else None,
                             "note": _step_note(PEER_NOTES[peer], samples["shardrec"], theirs, "records") if theirs
                             else "peer not installed (make bench installs it)"})
            ours_two = statistics.median(o["ids_per_s"] for o in two["shardrec"])
            rows.append({"workload": "sparse_step", "dim": dim, "optimizer": opt, "ranks": 2,
                         "peer": "shardrec 1 rank", "feed": "records", "unit": "ids/s (aggregate)",
                         "shardrec": ours_two, "peer_value": ours,
                         "note": _step_note("2 ranks on the same cores against 1 rank", two["shardrec"], None,
                                            "records")})
            theirs = two.get("tfra_horovod")
            rows.append({"workload": "sparse_step", "dim": dim, "optimizer": opt, "ranks": 2, "peer": "tfra_horovod",
                         "feed": "records", "unit": "ids/s (aggregate)", "shardrec": ours_two,
                         "peer_value": statistics.median(o["ids_per_s"] for o in theirs) if theirs else None,
                         "note": _step_note("TFRA sharded with Horovod all-to-all", two["shardrec"], theirs, "records")
                         if theirs else "peer not installed (make bench installs it)"})
    step_only = _step_runs(("shardrec", "tfra"), 16, "lazy_adam", size + ["--feed", "step-only"], repeats, short)
    if "tfra" in step_only:
        rows.append({"workload": "sparse_step", "dim": 16, "optimizer": "lazy_adam", "ranks": 1,
                     "peer": "tfra (step-only feed)", "feed": "step-only", "unit": "ids/s",
                     "shardrec": statistics.median(o["ids_per_s"] for o in step_only["shardrec"]),
                     "peer_value": statistics.median(o["ids_per_s"] for o in step_only["tfra"]),
                     "note": _step_note(PEER_NOTES["tfra"], step_only["shardrec"], step_only["tfra"], "step-only")})
    return rows


def admission(short, repeats):
    """The sparse step with feature admission (access_threshold 2) and eviction every 100 steps
    (keys unseen for 20 steps; the timestamps are the step numbers, the 40 batches cycle, so each
    round evicts the keys of the batches not seen lately, which come back and are admitted again),
    against the same step with neither; and with admission alone. 200 timed steps (4 windows of 50)
    so that the timed steps hold two evictions. --short: 60 steps (2 windows), an eviction every 20."""
    size = (["--distinct", "1000000", "--steps", "60", "--warmup", "2", "--windows", "2"] if short
            else ["--distinct", "10000000", "--steps", "200", "--warmup", "5"])
    every = 20 if short else 100
    variants = {"neither": [], f"admission 2, eviction every {every} steps": ["--faae", "--evict-every", str(every)],
                "admission 2 alone": ["--faae", "--evict-every", "0"]}
    samples, counters = {}, {}
    for _ in range(repeats):
        for name, flags in variants.items():
            log(f"sparse step: shardrec dim 16 lazy_adam, {name}")
            out = json_line(run([sys.executable, "bench/sparse_step.py", "--peer", "shardrec", "--dim", "16",
                                 "--optimizer", "lazy_adam"] + size + flags))
            samples.setdefault(name, []).append(out["ids_per_s"])
            counters[name] = out.get("table_counters")
    base = statistics.median(samples["neither"])
    return [{"workload": "sparse_step_admission", "dim": 16, "optimizer": "lazy_adam", "ranks": 1,
             "peer": "shardrec, neither", "unit": "ids/s", "shardrec": statistics.median(samples[name]),
             "peer_value": base, "table": counters[name],
             "note": f"{name}; table at the end: " + ", ".join(f"{k} {v}" for k, v in counters[name].items())}
            for name in variants if name != "neither"]


def disk_speed(directory):
    """The disk under `directory`: sequential direct reads (MB/s) and random 4 KiB direct reads
    (IOPS), of a 256 MiB file written there; what an SSD row read costs when not in the page cache."""
    path = os.path.join(directory, "shardrec-disk-speed.bin")
    size = 256 * 2**20
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 2**20)
            start = time.perf_counter()
            for offset in range(0, size, 2**20):
                os.preadv(fd, [buf], offset)
            sequential = size / (time.perf_counter() - start) / 1e6
            page, rng, reads = mmap.mmap(-1, 4096), random.Random(1), 3000
            start = time.perf_counter()
            for _ in range(reads):
                os.preadv(fd, [page], rng.randrange(size // 4096) * 4096)
            iops = reads / (time.perf_counter() - start)
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    return {"sequential_mb_per_s": round(sequential), "random_4k_iops": round(iops)}


def tiers(short, repeats):
    """The sparse step with an SSD tier (issue 14): 10% and 1% of the keys in memory against every key in
    memory, dim 16, lazy Adam, batches of 256 x 26 ids (1600 distinct batches, 1.17M distinct keys; the
    budget must hold the batches in flight), prefetch 1 for all three, timed after one full pass (steady
    state: every key has a row). Both swap policies are run (SHARDREC_SWAP_POLICY); the SSD bytes read per
    step are set against the disk's own speed. --short: 200 warm-up and 100 timed steps, on the same
    1600 batches (fewer would leave the 1% budget too small for the batches in flight)."""
    common = ["bench/sparse_step.py", "--peer", "shardrec", "--dim", "16", "--optimizer", "lazy_adam", "--batch", "256",
              "--prefetch", "1", "--distinct", "10000000"] + (["--batches", "1600", "--warmup", "200", "--steps", "100"] if short else
                                    ["--batches", "1600", "--warmup", "1600", "--steps", "400"])
    variants = {"all in memory": ([], None), "10% in memory (lfu)": (["--memory-fraction", "0.1"], "lfu"),
                "1% in memory (lfu)": (["--memory-fraction", "0.01"], "lfu"),
                "10% in memory (lru)": (["--memory-fraction", "0.1"], "lru"),
                "1% in memory (lru)": (["--memory-fraction", "0.01"], "lru")}
    samples, details = {}, {}
    for _ in range(repeats):
        for name, (flags, policy) in variants.items():
            log(f"sparse step: shardrec dim 16 lazy_adam, {name}")
            env = {"SHARDREC_SWAP_POLICY": policy} if policy else None
            out = json_line(run([sys.executable] + common + flags, env=env))
            samples.setdefault(name, []).append(out["ids_per_s"])
            details[name] = out.get("tiers")
    disk = disk_speed(tempfile.gettempdir())
    base = statistics.median(samples["all in memory"])
    rows = []
    for name in variants:
        if name == "all in memory":
            continue
        t = details[name]
        rows.append({"workload": "sparse_step_tiers", "dim": 16, "optimizer": "lazy_adam", "ranks": 1,
                     "peer": "shardrec, all in memory", "unit": "ids/s", "shardrec": statistics.median(samples[name]),
                     "peer_value": base, "tiers": t, "disk": disk,
                     "note": f"{name}; memory hit ratio {t['memory_hit_ratio']:.2f}, {t['rows_in_per_step']:.0f} rows "
                             f"in and {t['rows_out_per_step']:.0f} out per step, SSD read "
                             f"{t['ssd_bytes_read_per_step'] / 1e3:.0f} kB/step ({t['ssd_read_mb_per_s']:.0f} MB/s) "
                             f"against the disk's {disk['sequential_mb_per_s']} MB/s sequential, "
                             f"{disk['random_4k_iops']} random 4 KiB reads/s"})
    return rows


def end_to_end(short, repeats):
    rows = []
    steps, traced = ("60", "5") if short else ("500", "30")
    results = {}
    for ranks in (1, 2):
        values, fractions, shares = [], [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as model_dir:
                log(f"end to end: Wide&Deep on {ranks} rank(s)")
                out = run([sys.executable, "examples/wide_deep.py", "--steps", steps, "--eval-samples", "4096",
                           "--model-dir", model_dir, "--trace-steps", traced], ranks=ranks)
            m = re.search(r"samples_per_s=(\d+) key_exchange_s=([0-9.]+) key_collectives_s=([0-9.]+) train_s=([0-9.]+)",
                          out)
            values.append(float(m.group(1)))
            fractions.append(float(m.group(2)) / float(m.group(4)))
            shares.append(float(re.search(r"row_exchange_share=([0-9.]+)", out).group(1)))
        results[ranks] = (statistics.median(values), statistics.median(fractions), statistics.median(shares))
    rows.append({"workload": "end_to_end", "ranks": 2, "peer": "shardrec 1 rank", "unit": "samples/s",
                 "shardrec": results[2][0], "peer_value": results[1][0],
                 "note": f"median of {repeats} runs, steady state (after 20 warm-up steps); key exchange (pipeline thread) {100 * results[2][1]:.0f}% of train time at 2 ranks, "
                         f"{100 * results[1][1]:.0f}% at 1; row all-to-all in flight {100 * results[2][2]:.0f}% of "
                         f"step time at 2 ranks, {100 * results[1][2]:.0f}% at 1 (traced steps, waits included)",
                 "key_exchange_share": {r: results[r][1] for r in results},
                 "row_exchange_share": {r: results[r][2] for r in results}})
    return rows


def memory(short):
    """Bytes per stored key with the table exactly full (capacity = keys) and as users size tables
    (capacity = 2x the keys); TFRA with its initial size set to the keys (its best practice); and
    with dynamic expansion (rows in use grow with the keys) at several sizes."""
    keys = "500000" if short else "5000000"
    batch = "100000" if short else "50000"
    out = {}
    runs = [("shardrec", "1", keys, False), ("shardrec", "2", keys, False), ("tfra", "1", keys, False)]
    runs += [("shardrec", "2", n, True) for n in (["500000"] if short else ["2000000", "5000000", "8000000"])]
    for peer, factor, n, expansion in runs:
        if peer_available(peer):
            log(f"memory: {peer}, {n} keys, capacity {factor}x{', dynamic expansion' if expansion else ''}")
            out[peer, factor, n, expansion] = json_line(run(
                [sys.executable, "bench/memory.py", "--peer", peer, "--keys", n, "--batch", batch,
                 "--capacity-factor", factor] + (["--expansion"] if expansion else [])))
    full, sized = out["shardrec", "1", keys, False]["bytes_per_key"], out["shardrec", "2", keys, False]["bytes_per_key"]
    payload = out["shardrec", "1", keys, False]["payload_bytes_per_key"]
    rows = [{"workload": "memory", "keys": int(keys), "peer": "payload (values + Adam slots)", "unit": "bytes/key",
             "shardrec": full, "peer_value": payload, "note": "table exactly full (capacity = keys); lower is better"},
            {"workload": "memory", "keys": int(keys), "peer": "payload (values + Adam slots)", "unit": "bytes/key",
             "shardrec": sized, "peer_value": payload,
             "note": "fixed size, capacity = 2x keys, as users size tables: the unused rows are allocated too"}]
    for (peer, _, n, expansion), result in out.items():
        if expansion:
            rows.append({"workload": "memory", "keys": int(n), "peer": "payload (values + Adam slots)",
                         "unit": "bytes/key", "shardrec": result["bytes_per_key"], "peer_value": payload,
                         "note": "dynamic expansion, created with room for 2x keys: rows in use grow with the keys; "
                                 "counted per key: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                  result["counted_bytes_per_key"].items())})
    tfra = out.get(("tfra", "1", keys, False))
    rows.append({"workload": "memory", "keys": int(keys), "peer": "tfra", "unit": "bytes/key", "shardrec": full,
                 "peer_value": tfra["bytes_per_key"] if tfra else None,
                 "note": "both sized for the keys (TFRA init_size = keys)" if tfra else
                 "peer not installed (make bench installs it)"})
    return rows


def scaling(short, repeats):
    """A core per rank (bench/scaling.py): 1 rank pinned to 1 core against 2 ranks pinned to a core
    each, alternating, medians of 3 rounds (1 in the short mode); efficiency = 2-rank aggregate /
    (2 x 1-rank), with each rank's step timeline."""
    size = ["--distinct", "1000000", "--batches", "4", "--steps", "8", "--warmup", "2"] if short else \
        ["--distinct", "10000000"]
    settings = [(16, "lazy_adam")] if short else [(16, "lazy_adam"), (128, "lazy_adam"), (16, "sgd")]
    rows = []
    for dim, optimizer in settings:
        log(f"scaling: dim {dim} {optimizer}, 1 rank on 1 core against 2 ranks on a core each")
        out = json_line(run([sys.executable, "bench/scaling.py", "--rounds", "1" if short else "3", "--dim", str(dim),
                             *(["--timeline", "3"] if short else []),
                             "--optimizer", optimizer] + size))
        one, two = out["timeline"]["one_rank"][0], out["timeline"]["many_ranks"]
        waits = statistics.mean(sum(v for k, v in t["split_ms"].items() if k.startswith("waiting for a rank"))
                                for t in two)
        moving = statistics.mean(sum(v for k, v in t["split_ms"].items() if k.startswith("moving rows")) for t in two)
        rows.append({"workload": "scaling", "dim": dim, "optimizer": optimizer, "ranks": 2,
                     "peer": "2 x shardrec 1 rank on 1 core", "unit": "ids/s (aggregate)",
                     "shardrec": out["many_ranks"], "peer_value": 2 * out["one_rank"],
                     "note": f"efficiency {out['efficiency']:.2f} (rounds: "
                             f"{', '.join(f'{b / (2 * a):.2f}' for a, b in out['rounds'])}); ms per step at 1 / 2 "
                             f"ranks: wall {one['step_ms']:.1f} / {statistics.mean(t['step_ms'] for t in two):.1f}, "
                             f"CPU {one['cpu_ms']:.1f} / {statistics.mean(t['cpu_ms'] for t in two):.1f}, compute "
                             f"{one['split_ms']['compute']:.1f} / "
                             f"{statistics.mean(t['split_ms']['compute'] for t in two):.1f}; at 2 ranks waiting for a "
                             f"rank {waits:.1f}, moving rows {moving:.1f} (`python bench/scaling.py`)",
                     "efficiency": out["efficiency"], "timeline": out["timeline"], "rounds": out["rounds"]})
    return rows


def exchange_only(short):
    """The native key exchange alone (no TensorFlow), a core per rank: weak scaling from 1 to 2
    ranks and the batch-time tail (p99 against the median)."""
    size = ["--distinct", "1000000", "--batches", "20", "--passes", "2"] if short else []
    out = {}
    for ranks in (1, 2):
        log(f"exchange only: {ranks} rank(s) pinned to a core each")
        out[ranks] = json_line(run([sys.executable, "bench/exchange_only.py"] + size, ranks=ranks, bind_to_core=True))
    one, two = out[1], out[2]
    return [{"workload": "exchange_only", "ranks": 2, "peer": "shardrec 1 rank (per rank)", "unit": "ids/s per rank",
             "shardrec": two["ids_per_s_per_rank"], "peer_value": one["ids_per_s_per_rank"],
             "note": f"weak-scaling efficiency {two['ids_per_s_per_rank'] / one['ids_per_s_per_rank']:.2f}; batch "
                     f"p99/median {two['p99_ms'] / two['median_ms']:.2f} at 2 ranks ({two['median_ms']:.1f} / "
                     f"{two['p99_ms']:.1f} ms), {one['p99_ms'] / one['median_ms']:.2f} at 1; inserting pass "
                     f"p99 {two['insert_pass_p99_ms']:.1f} ms",
             "one_rank": one, "two_ranks": two}]


def checkpoint(short):
    """shardrec's Saver on one rank's table against plain writes and reads of the same bytes in the
    same files, same process (bench/checkpoint.py)."""
    keys = "500000" if short else "5000000"
    with tempfile.TemporaryDirectory(dir=ROOT) as d:
        log(f"checkpoint: save and restore of {keys} keys")
        ours = json_line(run([sys.executable, "bench/checkpoint.py", "--keys", keys, "--dir", d]))
    note = f"{int(keys) // 10**6}M keys, dim 16 + lazy Adam slots, {ours['bytes'] / 2**20:.0f} MB of files"
    return [{"workload": "checkpoint_save", "peer": "plain write+fsync of the same arrays", "unit": "MB/s",
             "shardrec": ours["save_mb_s"], "peer_value": ours["plain_write_mb_s"],
             "note": note + "; saves and plain writes alternate, medians"},
            {"workload": "checkpoint_restore", "peer": "plain read of the same files", "unit": "MB/s",
             "shardrec": ours["restore_mb_s"], "peer_value": ours["plain_read_mb_s"],
             "note": note + "; page cache dropped first"}]


def machine():
    import tensorflow as tf

    versions = {"tensorflow": tf.__version__, "python": platform.python_version()}
    for name in ("horovod", "mpi4py", "numpy", "tensorflow_recommenders_addons"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"cores": psutil.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "cpu": platform.processor() or platform.machine(), "versions": versions}


def table(rows):
    lines = ["| workload | setting | unit | shardrec | peer | peer value | ratio | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        setting = ", ".join(f"{k}={r[k]}" for k in ("dim", "optimizer", "ranks", "keys") if k in r)
        ours, theirs = r["shardrec"], r["peer_value"]
        ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
        fmt = lambda v: "-" if v is None else (f"{v / 1e6:.2f}M" if v > 1e5 else f"{v:.0f}")
        lines.append(f"| {r['workload']} | {setting} | {r['unit']} | {fmt(ours)} | {r['peer']} | {fmt(theirs)} | "
                     f"{ratio} | {r['note']} |")
    return "\n".join(lines)


SECTIONS = {"sparse_step": sparse_step, "admission": admission, "tiers": tiers,
            "end_to_end": lambda short, repeats: end_to_end(short, repeats if short else max(2, repeats)),
            "scaling": scaling,
            "exchange_only": lambda short, repeats: exchange_only(short),
            "memory": lambda short, repeats: memory(short),
            "checkpoint": lambda short, repeats: checkpoint(short)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="a quick check (under 3 minutes)")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure (default 1 short, 2 full)")
    p.add_argument("--only", nargs="+", choices=sorted(SECTIONS), default=None,
                   help="run these sections alone; their rows replace the same sections' rows of --out, the others "
                        "are kept (with the date and command of the run that measured them)")
    p.add_argument("--out", default=os.path.join(HERE, "results.json"))
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.short else 2)
    started = time.time()
    sections = args.only or list(SECTIONS)
    runs = {name: {"date": datetime.date.today().isoformat(),
                   "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                   "rows": SECTIONS[name](args.short, repeats)} for name in sections}
    if args.only and os.path.exists(args.out):
        with open(args.out) as f:
            earlier = json.load(f)
        kept = {name: {"date": earlier["date"], "command": earlier["command"], "rows": []} for name in SECTIONS}
        for row in earlier["rows"]:
            section = row.get("section") or _section_of(row["workload"])
            kept[section]["date"], kept[section]["command"] = row.get("date", earlier["date"]), \
                row.get("command", earlier["command"])
            kept[section]["rows"].append(row)
        runs = {name: runs.get(name) or kept[name] for name in SECTIONS if name in runs or kept[name]["rows"]}
    rows = [dict(row, section=name, date=run["date"], command=run["command"])
            for name, run in runs.items() for row in run["rows"]]
    report = {"date": datetime.date.today().isoformat(), "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              "mode": "short" if args.short else "full", "repeats": repeats, "seconds": round(time.time() - started),
              "machine": machine(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(rows))
    print(f"\n{report['date']}, {report['machine']['cores']} cores, {report['machine']['memory_gib']} GiB, "
          f"{report['seconds']} s; JSON in {os.path.relpath(args.out, ROOT)}")


def _section_of(workload):
    """The section of a row written before rows named their section."""
    return {"sparse_step_admission": "admission", "sparse_step_tiers": "tiers", "checkpoint_save": "checkpoint",
            "checkpoint_restore": "checkpoint"}.get(workload, workload)


if __name__ == "__main__":
    main()
