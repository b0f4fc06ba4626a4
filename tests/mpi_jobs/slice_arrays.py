"""World.send_arrays / receive_arrays (a column-wise table's save) when a rank answers too late:
rank 0 gives up waiting for rank 1; only then (after a barrier) rank 1 sends (small sends may
complete on its side: MPI sends them eagerly). A second round must then fail at once on rank 0,
naming the earlier timeout, and never hand it the late arrays as if they were the second round's.

    mpiexec -np 2 python slice_arrays.py
"""
import numpy as np
from mpi4py import MPI

from shardrec.rank_runtime import get_rank_id, init
from shardrec.rank_runtime.process.world import get_world

if __name__ == "__main__":
    init()
    world, rank = get_world(), get_rank_id()
    late = [np.arange(6, dtype=np.int64), np.ones((6, 2), np.float32)]
    if rank == 0:
        try:
            world.receive_arrays(1, "round 1", timeout=1.0)
        except TimeoutError as e:
            print(f"ROUND1 rank=0 {type(e).__name__}: {e}", flush=True)
        MPI.COMM_WORLD.Barrier()
    else:
        MPI.COMM_WORLD.Barrier()  # rank 0 has given up: this send is late
        try:
            world.send_arrays(0, late, "round 1", timeout=1.0)
        except TimeoutError as e:
            print(f"ROUND1 rank=1 {type(e).__name__}: {e}", flush=True)
    MPI.COMM_WORLD.Barrier()
    try:
        if rank == 0:
            got = world.receive_arrays(1, "round 2", timeout=5.0)
            print(f"ROUND2 rank=0 GOT {[a.tolist() for a in got]}", flush=True)
        else:
            world.send_arrays(0, [np.arange(3, dtype=np.int64)], "round 2", timeout=5.0)
            print("ROUND2 rank=1 SENT", flush=True)
    except RuntimeError as e:
        print(f"ROUND2 rank={rank} {type(e).__name__}: {e}", flush=True)
