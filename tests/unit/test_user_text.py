"""Tier (a), and processes where nothing less proves it: the text users read is for them. README opens with what
commfuse is, the set-up commands and how to use it, and its set-up and install lines are true; no doc, comment or
output cites an issue number; the hidden fraction is defined in one place; the examples say how to launch them
when started without torchrun, and the Llama example prints no torch warning it could avoid."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: commfuse requires tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def sections(text: str) -> dict[str, str]:
    """``## `` title -> body, in order."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


# -- README ------------------------------------------------------------------------------------------------------


def test_readme_says_what_commfuse_is_then_how_to_set_up_then_how_to_use_it():
    intro = README.split("\n## ", 1)[0]
    assert "commfuse" in intro and len(intro.split()) > 40, "README must open with what commfuse is"
    titles = list(sections(README))
    assert titles[:2] == ["Set up", "Use it in your model"], titles


def test_readme_set_up_is_the_two_commands_and_says_what_they_install():
    body = sections(README)["Set up"]
    commands = re.findall(r"```bash\n(.*?)```", body, flags=re.DOTALL)
    assert [c.strip() for c in commands] == ["bash ci/main.sh", "bash ci/test.sh"], commands
    for script in ("ci/main.sh", "ci/test.sh"):
        assert (ROOT / script).is_file()
    setup = (ROOT / "ci" / "setup.sh").read_text()
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', setup).group(1).split(",")
    for extra in extras:  # what ci/setup.sh installs, README says
        assert f"`{extra}`" in body, f"README's set-up does not say it installs the {extra!r} extra"


def test_readme_install_lines_name_every_extra_as_installed_from_a_clone():
    body = sections(README)["Use it in your model"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in extras:
        assert f"pip install '.[{extra}]'" in body, f"README's install lines lack pip install '.[{extra}]'"


def test_no_hint_installs_commfuse_from_a_package_index():
    """commfuse is installed from a clone (``pip install '.[bench]'``); ``commfuse[bench]`` names a package index."""
    found = [f"{path.relative_to(ROOT)}:{n}" for path in _user_text_files()
             for n, text in enumerate(path.read_text().splitlines(), 1) if re.search(r"commfuse\[\w+\]", text)]
    assert not found, found


# -- no issue numbers --------------------------------------------------------------------------------------------

#: A reference to an issue tracker's entry, which a user cannot see: "issue 5", "issue #13", "issue 13's".
ISSUE = re.compile(r"\bissues?\s+#?\d+|\bissue\s*#\d+|\(issue:", re.IGNORECASE)
#: The same, said without the number.
THE_ISSUE = re.compile(r"\bthe issue's\b", re.IGNORECASE)


def _user_text_files():
    yield from (ROOT / name for name in ("README.md", "CONTRIBUTING.md"))
    yield from sorted((ROOT / "docs").glob("*.md"))
    for top in ("commfuse", "benchmarks", "examples", "ci"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".sh", ".md") and "__pycache__" not in path.parts:
                yield path


def test_no_doc_comment_or_output_cites_an_issue_number():
    found = [f"{path.relative_to(ROOT)}:{n}: {text.strip()}" for path in _user_text_files()
             for n, text in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(text)]
    assert not found, "say what the thing is instead of citing an issue:\n" + "\n".join(found)


def test_docs_and_the_bench_do_not_lean_on_an_issue_the_reader_cannot_see():
    paths = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "commfuse" / "bench").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{n}: {text.strip()}" for path in paths
             for n, text in enumerate(path.read_text().splitlines(), 1) if THE_ISSUE.search(text)]
    assert not found, "\n".join(found)


# -- the hidden fraction, defined once ----------------------------------------------------------------------------


def test_the_hidden_fraction_is_defined_in_docs_benchmarks_and_contributing_points_there():
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "### The hidden fraction" in bench
    assert len(re.findall(r"hidden_fraction = ", bench)) == 1, "docs/benchmarks.md must define it exactly once"
    assert "min(compute, comm)" in bench
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert "docs/benchmarks.md#the-hidden-fraction" in contributing
    assert "hidden_fraction = " not in contributing and "min(compute" not in contributing, \
        "CONTRIBUTING.md restates the definition: point to docs/benchmarks.md instead"


# -- the examples, started without torchrun -----------------------------------------------------------------------


@pytest.mark.parametrize("script", ["tp_mlp.py", "llama_block.py"])
def test_an_example_started_without_torchrun_says_how_to_start_it(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    said = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(said) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "WORLD_SIZE is not set" in said[0] and f"torchrun --nproc-per-node 4 examples/{script}" in said[0]


def test_the_llama_example_prints_no_redistribution_warning():
    """clip_grad_norm_'s norm over a dp x tp mesh: torch warns (once per rank) about two sequential all-reduces
    unless a flattened mesh exists, which the example makes."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.fail("torchrun is not installed next to this Python")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "4", str(ROOT / "examples" / "llama_block.py"),
                           "--tp", "2", "--steps", "1"], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "step 0: loss" in done.stdout
    assert "_NormPartial" not in done.stderr and "sequential all_reduce" not in done.stderr, done.stderr[-4000:]
