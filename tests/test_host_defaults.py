"""MPI's waits yield their core by default: init() sets Open MPI's yield_when_idle before MPI starts
(a rank's step, key pipeline and exchanges share its core), keeps a value the user set, and says
what to do when the script started MPI itself first. And init() tells glibc to keep freed memory
for reuse (a step's large tensors are otherwise faulted in afresh every step), unless told not to."""
import os
import subprocess
import sys

SCRIPT = """
import os, sys
if sys.argv[1] == "mpi_first":
    from mpi4py import MPI
from shardrec.rank_runtime import init
init()
print("VALUE", os.environ.get("OMPI_MCA_mpi_yield_when_idle"))
"""


def _run(mode, **env):
    base = {k: v for k, v in os.environ.items() if k != "OMPI_MCA_mpi_yield_when_idle"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env=dict(base, TF_CPP_MIN_LOG_LEVEL="2", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("VALUE ")[1].strip(), proc.stderr


def test_init_makes_mpi_waits_yield_before_mpi_starts():
    value, stderr = _run("init_first")
    assert value == "1" and "MPI started before init()" not in stderr


def test_a_value_the_user_set_is_kept():
    value, stderr = _run("init_first", OMPI_MCA_mpi_yield_when_idle="0")
    assert value == "0" and "MPI started before init()" not in stderr


def test_a_script_that_started_mpi_first_is_told_how_to_set_it():
    value, stderr = _run("mpi_first")
    assert value == "None"
    assert "MPI started before init() (mpi4py.MPI was imported first)" in stderr
    assert "set OMPI_MCA_mpi_yield_when_idle=1 in the environment of the job" in stderr


# A 64 MB block (above glibc's largest mmap threshold) allocated, written and freed three times
# after init(): the kernel's count of page faults says whether the pages were kept for reuse.
REUSE = """
import ctypes, resource
from shardrec.rank_runtime import init
init()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
n = 64 << 20
def write_once():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
write_once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    write_once()
print("FAULTS", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 3 * (64 << 20) // 4096


def _faults(wrapper=(), **env):
    base = {k: v for k, v in os.environ.items() if k not in ("SHARDREC_KEEP_FREED_MEMORY", "GLIBC_TUNABLES")}
    proc = subprocess.run([*wrapper, sys.executable, "-c", REUSE], capture_output=True, text=True, timeout=120,
                          env=dict(base, TF_CPP_MIN_LOG_LEVEL="2", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split("FAULTS ")[1])


def test_init_keeps_freed_memory_so_a_large_block_is_not_faulted_in_again():
    assert _faults() < PAGES // 20


def test_freed_memory_goes_back_to_the_system_when_told_to():
    assert _faults(SHARDREC_KEEP_FREED_MEMORY="0") > PAGES * 9 // 10


def test_malloc_tunables_the_user_set_are_left_alone():
    assert _faults(GLIBC_TUNABLES="glibc.malloc.tcache_count=7") > PAGES * 9 // 10


def test_a_process_under_a_data_limit_gives_freed_memory_back():
    """Kept memory and the heap's top pad would count against the limit (an SSD-tiered table trained
    under RLIMIT_DATA ran out of memory with them, tests/test_tiers.py)."""
    limit = 16 << 30
    assert _faults(wrapper=("prlimit", f"--data={limit}:{limit}")) > PAGES * 9 // 10
