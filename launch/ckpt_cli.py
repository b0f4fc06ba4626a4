"""shardrec-ckpt: look into checkpoints without starting TensorFlow.

    shardrec-ckpt inspect DIR [--no-verify]

DIR is a model directory (every checkpoint in it), a sparse-<name> directory or a dense
checkpoint prefix. Prints each checkpoint's step, world size, tables with their dims, optimizer
slots and rows per rank, and whether every file matches its manifest (size and CRC-32). Exits 1
when any checkpoint is incomplete or damaged, 2 on bad arguments.
"""
import argparse
import sys

from orchestrator.checkpoints import find_checkpoints


def _describe(ckpt):
    lines = [f"{ckpt.name}: step {ckpt.step}, world size {ckpt.world_size}, "
             f"{'OK' if ckpt.ok else 'DAMAGED OR INCOMPLETE'}  ({ckpt.sparse_dir})"]
    tables = {}
    for rank, shard in sorted(ckpt.shards.items()):
        for name, entry in ((shard.manifest or {}).get("tables") or {}).items():
            tables.setdefault(name, (entry.get("dim"), entry.get("slots"), {}))[2][rank] = entry.get("rows")
    for name, (dim, slots, rows) in sorted(tables.items()):
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in sorted(rows.items()))
        lines.append(f"  table {name}: dim {dim}, slots {slots or []}, rows {sum(rows.values())} ({per_rank})")
    for problem in ckpt.problems + [p for s in ckpt.shards.values() for p in s.problems]:
        lines.append(f"  problem: {problem}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="shardrec-ckpt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="list checkpoints and check their files")
    inspect.add_argument("path")
    inspect.add_argument("--no-verify", action="store_true", help="check sizes only, not checksums (faster)")
    args = p.parse_args(argv)
    try:
        checkpoints = find_checkpoints(args.path, verify=not args.no_verify)
    except FileNotFoundError as e:
        print(f"shardrec-ckpt: {e}", file=sys.stderr)
        return 2
    if not checkpoints:
        print(f"shardrec-ckpt: no shardrec checkpoint (sparse-* directory) in {args.path}", file=sys.stderr)
        return 1
    for ckpt in checkpoints:
        print(_describe(ckpt))
    return 0 if all(c.ok for c in checkpoints) else 1


if __name__ == "__main__":
    sys.exit(main())
