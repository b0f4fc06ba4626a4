"""shardrec-ckpt: look into checkpoints without starting TensorFlow.

    shardrec-ckpt inspect DIR [--no-verify]
    shardrec-ckpt export DIR --table T [--out FILE.npz]

DIR is a model directory (every checkpoint in it), a sparse-<name> directory or a dense
checkpoint prefix. `inspect` prints each checkpoint's step, world size, tables with their dims,
optimizer slots, placement and rows per rank (and the sharding plan it was saved under), and whether every file matches its manifest (size, CRC-32,
row counts) and the dense part (index, data, meta graph) is there; then the staging directories
(.sparse-<name>.saving) of saves that did not finish. `export` writes every rank's
rows of one table from one checkpoint (the newest complete one of a model directory) into one
.npz: `keys`, `values` and each optimizer slot as `<optimizer>.<slot>`, rows aligned with keys
(np.load(FILE, allow_pickle=False) reads it). Exit status: 0 fine, 1 when a checkpoint is
incomplete or damaged (or the table is missing), 2 on bad arguments.
"""
import argparse
import os
import sys
from typing import List, Optional

import numpy as np

from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows, unfinished_saves
from shardrec.rank_runtime.formats.sharding_plan import ShardingPlan
from shardrec.rank_runtime.formats.sparse_checkpoint import CheckpointError


def _describe(ckpt):
    previous = ckpt.previous
    kind = f"delta on {previous.name}, " if previous is not None else ""
    lines = [f"{ckpt.name}: step {ckpt.step}, {kind}world size {ckpt.world_size}, "
             f"{'OK' if ckpt.ok else 'DAMAGED OR INCOMPLETE'}  ({ckpt.sparse_dir})"]
    tables, plans = {}, {}
    for rank, shard in sorted(ckpt.shards.items()):
        for name, entry in (shard.manifest.tables if shard.manifest else {}).items():
            tables.setdefault(name, (entry.dim, entry.slots, {}))[2][rank] = entry.rows
            if entry.sharding is not None:
                plans.setdefault(name, entry.sharding)
    for name, (dim, slots, rows) in sorted(tables.items()):
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in sorted(rows.items()))
        what = "rows changed" if kind else "rows"
        placed = f", {plans[name].placement.describe()}" if name in plans else ""
        lines.append(f"  table {name}: dim {dim}, slots {slots or []}{placed}, {what} {sum(rows.values())} "
                     f"({per_rank})")
    if plans and ckpt.world_size is not None:
        text = ShardingPlan(ckpt.world_size, plans).render()
        lines += ["  the sharding plan it was saved under:"] + [f"    {line}" for line in text.splitlines()]
    for problem in ckpt.problems + [p for s in ckpt.shards.values() for p in s.problems]:
        lines.append(f"  problem: {problem}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="shardrec-ckpt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="list checkpoints and check their files")
    inspect.add_argument("path")
    inspect.add_argument("--no-verify", action="store_true", help="check sizes only, not checksums (faster)")
    export = sub.add_parser("export", help="one table's rows of every rank into one .npz")
    export.add_argument("path")
    export.add_argument("--table", required=True)
    export.add_argument("--out", help="the .npz to write (default: <table>.npz in the current directory)")
    args = p.parse_args(argv)
    try:
        checkpoints = find_checkpoints(args.path, verify=args.command == "export" or not args.no_verify)
    except FileNotFoundError as e:
        print(f"shardrec-ckpt: {e}", file=sys.stderr)
        return 2
    if not checkpoints:
        print(f"shardrec-ckpt: no shardrec checkpoint (sparse-* directory) in {args.path}", file=sys.stderr)
        return 1
    if args.command == "export":
        return _export(checkpoints, args.table, args.out or f"{args.table}.npz")
    for ckpt in checkpoints:
        print(_describe(ckpt))
    for staged in unfinished_saves(args.path):
        print(f"{staged}: the shards of a save that did not finish (killed or failed); not a checkpoint, and the "
              "checkpoint of that name, if listed above, is as it was before; the next save of that step "
              "removes it")
    return 0 if all(c.ok for c in checkpoints) else 1


def _export(checkpoints, table, out):
    complete = [c for c in checkpoints if c.ok]
    if not complete:
        print(_describe(checkpoints[-1]), file=sys.stderr)
        print("shardrec-ckpt: no complete checkpoint to export from", file=sys.stderr)
        return 1
    ckpt = complete[-1]
    try:
        arrays = table_rows(ckpt, table)
    except CheckpointError as e:
        print(f"shardrec-ckpt: {e}", file=sys.stderr)
        return 1
    if not out.endswith(".npz"):
        out += ".npz"
    tmp = f"{out}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, out)
    print(f"{ckpt.name} (step {ckpt.step}): table {table}: {len(arrays['keys'])} rows of "
          f"{', '.join(sorted(arrays))} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
