"""The set-up (scripts/bootstrap.sh): the Horovod wheel it keeps in the machine's cache works in
every clone, also once the clone that built it is gone. The wheel's library search path is made
relative to the installed package (scripts/relocate_wheel.py); before, it named the building
clone's venv, and in every other clone `hvd.init()` failed with `libmpi.so.40: cannot open shared
object file` as soon as that venv was removed."""
import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
CACHE = os.environ.get("SHARDREC_WHEEL_CACHE", os.path.expanduser("~/.cache/shardrec/wheels"))


def runpath(library):
    out = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    line = next((line for line in out.splitlines() if "(RUNPATH)" in line or "(RPATH)" in line), None)
    return [] if line is None else line.split("[", 1)[1].rstrip("]").split(":")


def test_a_second_clone_set_up_from_the_cached_wheel_runs_horovod_without_the_first(tmp_path):
    # The wheel this checkout's set-up built (or found) in the machine's cache, keyed as bootstrap.sh keys it.
    import mpi4py
    import tensorflow as tf

    key = f"tf{tf.__version__}-mpi4py{mpi4py.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-origin"
    [cached] = glob.glob(os.path.join(CACHE, f"horovod-*-{key}"))
    cache = tmp_path / "cache"
    shutil.copytree(cached, cache / os.path.basename(cached))
    clone = tmp_path / "second-clone"
    shutil.copytree(os.path.join(ROOT, "scripts"), clone / "scripts")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    setup = subprocess.run(["bash", str(clone / "scripts" / "bootstrap.sh"), "--deps-only"], capture_output=True,
                           text=True, timeout=900, env=dict(env, SHARDREC_WHEEL_CACHE=str(cache)))
    assert setup.returncode == 0, setup.stderr[-3000:]
    assert "reusing cached horovod wheel" in setup.stderr
    [library] = glob.glob(str(clone / ".venv" / "lib" / "python*" / "site-packages" / "horovod" / "tensorflow" /
                               "mpi_lib*.so"))
    entries = runpath(library)
    assert entries, "the library finds libmpi through its RUNPATH"
    outside = [e for e in entries if os.path.isabs(e) and not e.startswith(str(clone))]
    assert not outside, f"RUNPATH {entries} names folders outside the second clone"
    # The first clone gone: this checkout's venv, and whatever else the RUNPATH names, hidden behind
    # empty folders in a mount namespace of the test's own. Horovod is imported first (nothing else
    # has loaded libmpi before it).
    hide = [VENV, *outside]
    mounts = " && ".join(f"mount -t tmpfs none '{path}'" for path in hide)
    python = clone / ".venv" / "bin" / "python"
    probe = "import horovod.tensorflow as hvd; hvd.init(); print('HOROVOD', hvd.size(), hvd.mpi_built())"
    unshare = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    run = subprocess.run([*unshare, "sh", "-c", f"{mounts} && ls -A '{VENV}' | wc -l && exec '{python}' -c \"{probe}\""],
                         capture_output=True, text=True, timeout=300, env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[:4] == ["0", "HOROVOD", "1", "True"], run.stdout
