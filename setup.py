# The native core is one pybind11 extension; everything else is declared in pyproject.toml.
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "shardrec_native",
    sources=["native/src/module.cpp"],
    include_dirs=["native/src"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
