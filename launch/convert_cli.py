"""shardrec-convert: TFRecord files of tf.train.Example to Parquet for ParquetDataset.

    shardrec-convert INPUT... --out DIR [--row-group-rows N] [--column NAME=KIND ...]
                     [--compression snappy|zstd|none] [--no-dictionary]

INPUT: TFRecord files or directories (a directory stream's partition folders are kept: DIR/0/,
DIR/1/, ...). Each file becomes one Parquet file of the same relative name with `.parquet`, written
under a dot-name and renamed into place when complete (so DIR may be a directory stream that
training reads meanwhile). The schema is the first file's first records' (--column limits and
declares it: KIND is id, float, ids, floats, or ids:K / floats:K for K values a row). Row groups
of --row-group-rows rows (default 65536: a training batch or several; ParquetDataset deals row
groups to ranks, so a rank count above the row groups leaves ranks idle). Columns are required
(no nulls: no definition levels to decode). pyarrow's Snappy and dictionary encoding by default;
--compression none --no-dictionary write what ParquetDataset decodes fastest (about 5 ns an id
against 19 for the defaults, a larger file: bench/README.md). Progress on stderr.
Exit status: 0 done, 1 a record or file that cannot be converted (named), 2 bad arguments.
"""
import argparse
import os
import sys
from typing import List, Optional

from shardrec.rank_runtime.input.convert import (ConvertError, Progress, convert_file, infer_fields, parse_columns,
                                                 sources)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="shardrec-convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="TFRecord files or directories")
    p.add_argument("--out", required=True, help="the output directory")
    p.add_argument("--row-group-rows", type=int, default=65536, help="rows a row group (default 65536)")
    p.add_argument("--column", action="append", default=[], metavar="NAME=KIND",
                   help="a column to write and its kind (repeat; default: every feature, kinds inferred)")
    p.add_argument("--compression", default="snappy", choices=["snappy", "zstd", "gzip", "lz4", "brotli", "none"],
                   help="the column chunks' compression (default snappy, pyarrow's)")
    p.add_argument("--no-dictionary", action="store_true", help="plain encoding, no dictionary pages")
    args = p.parse_args(argv)
    if args.row_group_rows < 1:
        p.error(f"--row-group-rows {args.row_group_rows}: allowed: 1 or more")
    declared = {}
    for text in args.column:
        name, sep, kind = text.partition("=")
        if not sep or not name:
            p.error(f"--column {text!r}: write NAME=KIND")
        declared[name] = kind
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        files = sources(args.inputs)
        inferred = {f.name: f for f in infer_fields(files[0][0])}
        if declared:
            fields = parse_columns(declared)
            missing = [f.name for f in fields if f.name not in inferred]
            if missing:
                raise ConvertError(f"{files[0][0]}: no feature {', '.join(map(repr, missing))} in its first records; "
                                   f"its features: {', '.join(sorted(inferred))}")
            fields = [type(f)(f.name, f.kind, f.fixed, inferred[f.name].strings) for f in fields]
        else:
            fields = list(inferred.values())
        print("schema: " + ", ".join(f"{f.name} {f.arrow_type()}" for f in fields), file=sys.stderr)
        progress = Progress(len(files))
        for source, relative in files:
            target = os.path.join(args.out, os.path.splitext(relative)[0] + ".parquet")
            convert_file(source, target, fields, args.row_group_rows, progress.add, compression=args.compression,
                         use_dictionary=not args.no_dictionary)
            progress.file_done()
        progress.end()
    except ConvertError as e:
        print(f"\nshardrec-convert: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
