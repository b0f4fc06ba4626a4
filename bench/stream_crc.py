"""What the directory stream's CRC check costs: the CPU time of counting a file's records from its
framing alone, and with both CRCs of every record checked (what DirectoryStream does to each file
it hands to tf.data since issue 54), against TensorFlow reading and parsing the same file, in
turns within one run.

    python bench/stream_crc.py [--records 50000] [--rounds 3]
"""
import argparse
import os
import tempfile
import time

import numpy as np
import tensorflow as tf

from shardrec.native import framing

COLUMNS = {"cat": tf.io.FixedLenFeature([26], tf.int64), "dense": tf.io.FixedLenFeature([13], tf.float32),
           "label": tf.io.FixedLenFeature([], tf.float32)}


def write_file(path: str, records: int) -> None:
    """Criteo-shaped examples: 26 int64 ids, 13 floats, a label."""
    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(path) as w:
        for _ in range(records):
            w.write(tf.train.Example(features=tf.train.Features(feature={
                "cat": tf.train.Feature(int64_list=tf.train.Int64List(value=rng.integers(0, 2**40, 26))),
                "dense": tf.train.Feature(float_list=tf.train.FloatList(value=rng.random(13))),
                "label": tf.train.Feature(float_list=tf.train.FloatList(value=[1.0]))})).SerializeToString())


def cpu_per_call(fn, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="shardrec-crc-"), "events.tfrecord")
    write_file(path, args.records)
    dataset = tf.data.TFRecordDataset(path).batch(4096).map(lambda r: tf.io.parse_example(r, COLUMNS))

    def read_and_parse():
        for _ in dataset:
            pass
    read_and_parse()  # warm: the page cache, TensorFlow's functions
    n = args.records
    print(f"{os.path.getsize(path) / 1e6:.1f} MB, {n} records; CPU ns per record")
    for r in range(args.rounds):
        plain = cpu_per_call(lambda: framing.count_tfrecords(path), 20)
        checked = cpu_per_call(lambda: framing.count_tfrecords(path, check_crc=True), 20)
        parsed = cpu_per_call(read_and_parse, 3)
        print(f"round {r}: framing {plain * 1e9 / n:.1f}, framing + CRCs {checked * 1e9 / n:.1f}, "
              f"TFRecordDataset + parse_example {parsed * 1e9 / n:.0f}; the CRCs add "
              f"{(checked - plain) / parsed:.2%} of reading and parsing")


if __name__ == "__main__":
    main()
