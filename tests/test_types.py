"""Types checked, not only written: mypy (pinned in scripts/requirements.txt, settings in
pyproject.toml's [tool.mypy]) over the formats between processes, the process room, the supervisor
and the commands, with no error; and the share of public functions whose every parameter and
return is annotated, printed per room: at least 90% in each."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMS = ("rank_runtime", "orchestrator", "launch")
# At least 90% of the public functions annotated in every room (issue 55).
FLOORS = {"rank_runtime": 0.90, "orchestrator": 0.90, "launch": 0.90}


def test_mypy_finds_no_error_in_the_checked_rooms():
    done = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout, done.stdout


def _public_functions(room):
    """(name, whether every parameter but self / cls and the return are annotated) of each public
    function and method of the room (names without a leading underscore, in classes without one)."""
    out = []
    for folder, _, files in os.walk(os.path.join(ROOT, room)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.ClassDef, ast.Module)) or getattr(node, "name", "x").startswith("_"):
                    continue
                for f in node.body:
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("_"):
                        params = [a for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs
                                  if a.arg not in ("self", "cls")]
                        typed = f.returns is not None and all(a.annotation is not None for a in params)
                        out.append((f"{os.path.relpath(path, ROOT)}:{f.name}", typed))
    return out


def test_the_share_of_annotated_public_functions_is_printed_and_held():
    shares = {}
    for room in ROOMS:
        functions = _public_functions(room)
        shares[room] = sum(typed for _, typed in functions) / len(functions)
        print(f"{room}: {sum(typed for _, typed in functions)} of {len(functions)} public functions annotated "
              f"({shares[room]:.0%})")
    low = {room: f"{share:.0%} < {FLOORS[room]:.0%}" for room, share in shares.items() if share < FLOORS[room]}
    assert not low, f"annotated public functions fell: {low}"
