"""MPI's waits yield their core by default: init() sets Open MPI's yield_when_idle before MPI starts
(a rank's step, key pipeline and exchanges share its core), keeps a value the user set, and says
what to do when the script started MPI itself first."""
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
