"""The README and docs/ stay true: links resolve, named source paths exist, the guide's Python
parses, every command option named is in that command's --help, and the init reference lists
exactly the parameters init() accepts."""
import ast
import glob
import inspect
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)) + [os.path.join(ROOT, "README.md")]
# Folders of this repository: a code span starting with one of them names a path that must exist.
TOP = ("rank_runtime/", "native/", "orchestrator/", "launch/", "tests/", "docker/", "examples/", "bench/",
       "scripts/", "mx_rec/", "docs/")
COMMANDS = ("shardrec-run", "shardrec-ckpt", "shardrec-export", "shardrec-serve", "shardrec-convert")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z-]*|-np|-H|-x|-n)(?![\w-])")


def rel(path):
    return os.path.relpath(path, ROOT)


def text_of(page):
    with open(page, encoding="utf-8") as f:
        return f.read()


def anchors(page):
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in text_of(page).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_the_readme_is_short_and_docs_has_every_part():
    assert len(text_of(os.path.join(ROOT, "README.md")).splitlines()) <= 200
    for part in ("guide", "internals", "reference"):
        assert glob.glob(os.path.join(ROOT, "docs", part, "*.md")), f"docs/{part}/ is empty"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    for target in LINK.findall(text_of(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(resolved), f"{rel(page)}: link {target!r} names {rel(resolved)}, which does not exist"
        if anchor and resolved.endswith(".md"):
            assert anchor in anchors(resolved), f"{rel(page)}: link {target!r}: no heading #{anchor} in {rel(resolved)}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_source_path_named_exists(page):
    for span in SPAN.findall(text_of(page)):
        for word in span.split():
            word = word.rstrip(".,;:)")
            if word.startswith(TOP) and not re.search(r"[<>{}$]", word):
                assert glob.glob(os.path.join(ROOT, word)), f"{rel(page)}: `{span}` names {word}, which does not exist"


def python_blocks(page):
    return [body for lang, body in FENCE.findall(text_of(page)) if lang == "python"]


def test_every_python_block_of_the_guide_and_readme_parses():
    pages = [p for p in PAGES if "/docs/guide/" in p or p.endswith("README.md")]
    blocks = [(p, b) for p in pages for b in python_blocks(p)]
    assert len(blocks) >= 3, blocks
    for page, block in blocks:
        try:
            ast.parse(block)
        except SyntaxError as e:
            pytest.fail(f"{rel(page)}: a Python block does not parse: {e}\n{block}")


def help_text(command):
    """Everything `command --help` says, subcommands' help included."""
    exe = os.path.join(os.path.dirname(sys.executable), command)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, env=env).stdout
    for sub in re.findall(r"\{([\w,]+)\}", text)[:1]:
        for name in sub.split(","):
            text += subprocess.run([exe, name, "--help"], capture_output=True, text=True, timeout=120, env=env).stdout
    assert "usage:" in text, command
    return text


def named_options():
    """{command: {option: [page, ...]}}: options named after a command in a code span or a code
    block line, and every option of the reference's section of that command."""
    found = {c: {} for c in COMMANDS}
    for page in PAGES:
        text = text_of(page)
        pieces = SPAN.findall(text) + [line for _, body in FENCE.findall(text) for line in body.splitlines()]
        if page.endswith(os.path.join("reference", "commands.md")):
            pieces += re.split(r"^## ", text, flags=re.M)
        for piece in pieces:
            for command in COMMANDS:
                if piece.lstrip().startswith((command, f"`{command}`")):
                    for option in OPTION.findall(piece[piece.index(command) + len(command):].split(" -- ")[0]):
                        found[command].setdefault(option, []).append(rel(page))
    return found


def test_every_command_option_the_docs_name_is_in_its_help():
    found = named_options()
    assert all(found.values()), f"no option found for some command: {found}"
    for command, options in found.items():
        helps = help_text(command)
        for option, pages in options.items():
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps), \
                f"{command} {option} is named in {sorted(set(pages))} but not in `{command} --help`"


def test_the_init_reference_lists_exactly_the_parameters_init_accepts():
    from shardrec.rank_runtime.process import lifecycle

    table = text_of(os.path.join(ROOT, "docs", "reference", "init.md"))
    documented = set()
    for row in table.splitlines():
        if row.startswith("| `"):
            documented.update(SPAN.findall(row.split(" | ")[0]))
    accepted = {name for name, p in inspect.signature(lifecycle.init).parameters.items()
                if p.kind is not inspect.Parameter.VAR_KEYWORD} | set(lifecycle._NO_COUNTERPART)
    assert documented == accepted, (f"documented, not accepted: {sorted(documented - accepted)}; "
                                    f"accepted, not documented: {sorted(accepted - documented)}")


def test_the_readme_s_training_script_trains_on_two_ranks(tmp_path):
    """The README's script, as it stands, run by mpiexec on 2 ranks: it trains to the end of its
    data and every rank holds a share of the ids."""
    from mpi_helpers import check, mpiexec

    [block] = python_blocks(os.path.join(ROOT, "README.md"))
    script = tmp_path / "train.py"
    script.write_text(block + "\nimport os\nprint('HELD', os.environ['OMPI_COMM_WORLD_RANK'], table.size(), flush=True)\n")
    proc = check(mpiexec(2, str(script), timeout=300))
    held = dict(map(int, line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("HELD"))
    assert set(held) == {0, 1} and all(n > 0 for n in held.values()), proc.stdout
    ids = np.random.default_rng(0).integers(0, 1000, (4096, 1))
    assert sum(held.values()) == len(np.unique(ids)), held
