"""Tier (a), no processes: the import graph of commfuse and the vendor packages has no circle, and the
layer contract in .importlinter is the one CI checks (docs/architecture.md explains it)."""

from __future__ import annotations

import configparser
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
VENDORS = {"commfuse_cuda": "cuda", "commfuse_npu": "npu", "commfuse_xla": "xla", "commfuse_template": "_template"}


def _graph():
    # The vendor folders go on sys.path only while grimp reads them: left there, a folder holding an
    # editable install's metadata (another test may have made one) would show its entry points to every
    # later plugin-discovery test in this process.
    saved = list(sys.path)
    sys.path.extend(str(ROOT / "backends" / folder) for folder in VENDORS.values())
    try:
        return grimp.build_graph("commfuse", *VENDORS, include_external_packages=False)
    finally:
        sys.path[:] = saved


def _circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x in graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_in_commfuse_or_the_vendor_packages():
    graph = _graph()
    assert len(graph.modules) > 50, sorted(graph.modules)  # the vendor folders and the package were found
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _circles(graph) == [["pkg.a", "pkg.b"]]


def test_every_commfuse_package_and_top_module_is_in_a_layer():
    """A new top-level module or package must be given its place in the layers, or lint-imports would not
    check it."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    text = config["importlinter:contract:layers"]["layers"]
    named = {name.strip() for line in text.splitlines() for name in line.replace(":", "|").split("|") if name.strip()}
    package = ROOT / "commfuse"
    children = {f"commfuse.{p.stem}" for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    children |= {f"commfuse.{p.name}" for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert children - named == set(), f"not in any layer of .importlinter: {sorted(children - named)}"
    assert named - children == set(), f"layers name what does not exist: {sorted(named - children)}"
