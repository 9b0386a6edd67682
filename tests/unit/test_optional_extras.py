"""Processes, where nothing less proves it: with pytest, matplotlib and numpy made unimportable in a fresh
interpreter (as after ``pip install .`` with no extras), the ``commfuse`` command starts, the subcommands that need
no extra run, and the parts that need one refuse before any work, naming the package and how to install it from
a clone. ``ci/test_plain_install.sh`` checks the same in a real environment with torch alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What ``pip install .`` does not bring: the ``test`` extra's pytest, the ``bench`` extra's matplotlib, and numpy.
ABSENT = ("pytest", "matplotlib", "numpy")

#: A file, not ``python -c``: ranks started with the spawn method import the parent's main file again (and a
#: script run through it imports it first), so they do not find the same modules. It replaces the finder of
#: installed packages by one that does not see the blocked ones: ``import`` raises and ``find_spec`` returns None,
#: as where they are not installed.
WRAPPER = textwrap.dedent('''
    import importlib.machinery
    import sys

    BLOCKED = {blocked!r}


    class NotInstalled(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                return None
            return super().find_spec(name, path, target)


    sys.meta_path[:] = [NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]

    if __name__ == "__main__":
        what, args = sys.argv[1], sys.argv[2:]
        sys.argv = [what, *args]
        try:
            if what == "commfuse":
                from commfuse.cli import main
                sys.exit(main(args))
            elif what == "bench":
                from commfuse.bench.command import main
                sys.exit(main(args))
            else:  # a script
                import runpy
                runpy.run_path(what, run_name="__main__")
        finally:  # also after --help's SystemExit
            shown = sorted(m for m in ("torch", *BLOCKED) if m in sys.modules)
            print("imported: " + " ".join(shown), file=sys.stderr)
''')


def run(tmp_path: Path, *args: str, blocked=ABSENT, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``commfuse ARGS``, ``python -m commfuse.bench ARGS`` (``bench``) or a script in ``tmp_path``, with
    ``blocked`` not installed. A script that starts ranks begins with ``import not_installed``."""
    wrapper = tmp_path / "not_installed.py"
    wrapper.write_text(WRAPPER.format(blocked=tuple(blocked)))
    return subprocess.run([sys.executable, str(wrapper), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, check=False)


def imported(done: subprocess.CompletedProcess) -> set[str]:
    line = [x for x in done.stderr.splitlines() if x.startswith("imported:")][-1]
    return set(line.split()[1:])


def refusal(done: subprocess.CompletedProcess) -> str:
    lines = [x for x in done.stderr.splitlines() if not x.startswith("imported:")]
    assert len(lines) == 1, f"expected the refusal alone, got:\n{done.stderr}"
    return lines[0]


def test_help_lists_every_subcommand_without_the_extras(tmp_path):
    done = run(tmp_path, "commfuse", "--help")
    assert done.returncode == 0, done.stderr
    for name in ("schedule", "backends", "bench", "simulate", "conformance"):
        assert name in done.stdout
    assert "(needs the 'test' extra)" in done.stdout
    assert imported(done) == set(), "commfuse --help imported more than argparse needs"


@pytest.mark.parametrize("args", [
    ("schedule", "show", "all_gather", "-n", "4"),
    ("backends",),
    ("simulate", "--profile", "h100-sxm", "--workload", "mlp", "--tp", "4", "--seq", "1024", "--hidden", "1024"),
    ("simulate", "profiles"),
], ids=["schedule-show", "backends", "simulate", "simulate-profiles"])
def test_subcommands_that_need_no_extra_run_without_them(tmp_path, args):
    done = run(tmp_path, "commfuse", *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_conformance_refuses_without_pytest_and_says_how_to_install_it(tmp_path):
    done = run(tmp_path, "commfuse", "conformance", "--backend", "gloo", "-n", "2", "--report", "r.json")
    assert done.returncode == 2, done.stderr
    said = refusal(done)
    assert "commfuse conformance needs pytest" in said and "pip install '.[test]'" in said, said
    assert "clone of the commfuse repository" in said
    assert not (tmp_path / "r.json").exists()
    assert "torch" not in imported(done), "it started work before refusing"
    helped = run(tmp_path, "commfuse", "conformance", "--help")
    assert helped.returncode == 0 and "pip install '.[test]'" in helped.stdout, helped.stdout


@pytest.mark.parametrize("entry", ["commfuse", "bench"])
def test_bench_plot_refuses_without_matplotlib_before_any_work(tmp_path, entry):
    args = (["bench"] if entry == "commfuse" else []) + ["--plot", "gantt.png", "--preset", "tiny", "-r", "1"]
    done = run(tmp_path, entry, *args)
    assert done.returncode == 2, done.stderr
    said = refusal(done)
    assert "--plot needs matplotlib" in said and "pip install '.[bench]'" in said, said
    assert "commfuse[" not in said  # commfuse is not on a package index: the extra installs from a clone
    assert not (tmp_path / "gantt.png").exists()
    assert "torch" not in imported(done), "it launched ranks (or imported torch) before refusing"


def test_plot_write_names_the_extra_to_install_from_a_clone(tmp_path):
    """A caller of ``commfuse.bench.plot.write`` itself (not the command, which checks first) gets the same hint."""
    script = tmp_path / "draw.py"
    script.write_text("from commfuse.bench import plot\n"
                      "from commfuse.errors import CommfuseError\n"
                      "try:\n    plot.write({'results': []}, 'x.png')\n"
                      "except CommfuseError as e:\n    print(e)\n")
    done = run(tmp_path, str(script))
    assert done.returncode == 0, done.stderr
    assert "pip install '.[bench]'" in done.stdout and "commfuse[" not in done.stdout, done.stdout
