"""Processes, where nothing less proves it: an editable install of a clone imports the clone's package from any
folder, also from the clone's parent, where the clone's root folder (named ``commfuse``) would otherwise be taken
for a namespace package and its ``backends/`` for ``commfuse.backends``.

Each case builds the editable wheel of a copy of this repository with setuptools' own PEP 660 hook, in the mode
a set-up asks for (none: what ``pip install -e .`` and ``ci/setup.sh`` do; ``strict``: setuptools' other mode,
``--config-settings editable_mode=strict``), puts its files in a site folder as pip would, and imports commfuse in
a fresh interpreter started in the copy's parent. The copy carries the repository's top-level folders, so
``backends/`` is there to shadow as it was."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import pluggy
import torch

ROOT = Path(__file__).resolve().parents[2]
#: What the build reads (the plain-install stage copies the same, ci/test_plain_install.sh).
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE")


def _clone(parent: Path) -> Path:
    """A copy of the repository named ``commfuse`` in ``parent``: what the build reads, the package, and the other
    top-level folders (empty, but for one file each, which is all a shadowing namespace package needs)."""
    clone = parent / "commfuse"
    clone.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy(ROOT / name, clone / name)
    shutil.copytree(ROOT / "commfuse", clone / "commfuse", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder in ROOT.iterdir():
        if folder.is_dir() and folder.name != "commfuse" and not folder.name.startswith(".") \
                and not folder.name.endswith(".egg-info"):
            (clone / folder.name).mkdir()
            (clone / folder.name / "README.md").write_text("a top-level folder of the clone\n")
    return clone


def _install_editable(clone: Path, site: Path, mode: str | None) -> list[str]:
    """Build ``clone``'s editable wheel (``editable_mode=mode``, None: setuptools' default) and put its files,
    less the metadata, into ``site``; the names put there."""
    out = clone.parent / "wheel"
    settings = {} if mode is None else {"editable_mode": mode}
    build = textwrap.dedent(f"""
        import setuptools.build_meta as backend
        print(backend.build_editable({str(out)!r}, config_settings={settings!r}))
    """)
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", build], cwd=clone, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    site.mkdir()
    names = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".dist-info/" not in name:
                z.extract(name, site)
                names.append(name)
    return names


#: Started with -S: no site folder's .pth runs (this environment's own editable install among them). The editable
#: site goes first, so that its .pth imports its own finder module (if any) and not this environment's of the same
#: name; then the folders torch and pluggy come from, without their .pth files.
CHECK = textwrap.dedent("""
    import site, sys
    site.addsitedir({site!r})
    sys.path += {deps!r}
    import commfuse
    import commfuse.backends
    print(commfuse.__file__)
    print(commfuse.backends.__file__)
    print(callable(getattr(commfuse.backends, "resolve", None)))
    print(callable(getattr(commfuse, "all_gather_matmul", None)))
""")


@pytest.mark.parametrize("mode", [None, "strict"], ids=["pip install -e", "strict"])
def test_editable_install_imports_the_clone_from_its_parent_folder(tmp_path, mode):
    parent = tmp_path / "parent"
    parent.mkdir()
    clone = _clone(parent)
    site = tmp_path / "site"
    installed = _install_editable(clone, site, mode)
    deps = sorted({str(Path(m.__file__).resolve().parents[1]) for m in (torch, pluggy)})
    code = CHECK.format(site=str(site), deps=deps)
    for where in (parent, clone, tmp_path):  # the clone's parent, the clone itself, elsewhere
        done = subprocess.run([sys.executable, "-S", "-c", code], cwd=where, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (where, installed, done.stderr[-3000:])
        package, backends, resolve, op = (Path(x) if x.startswith("/") else x for x in done.stdout.split("\n")[:4])
        # strict mode imports through links to the clone's files (a link tree in the clone's build/ folder)
        assert package.resolve() == clone / "commfuse" / "__init__.py", (where, installed, done.stdout)
        assert backends.resolve() == clone / "commfuse" / "backends.py", (where, installed, done.stdout)
        assert resolve == "True" and op == "True", (where, installed, done.stdout)
