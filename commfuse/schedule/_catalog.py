"""The ``schedules/`` catalog: golden step tables, one file per variant and world size.

The catalog is the human-readable specification every backend must honour.
``commfuse schedule dump`` rewrites it from the builders; the test suite fails
when a builder's output differs from its file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from commfuse.schedule._builders import ALGORITHMS, build
from commfuse.schedule._ir import Algorithm, Collective
from commfuse.schedule._render import render

WORLD_SIZES = (2, 3, 4, 8)


@dataclass(frozen=True)
class Entry:
    collective: Collective
    algorithm: Algorithm
    parts: int = 1
    chunks: int = 1

    @property
    def variant(self) -> str:
        name = self.algorithm.value
        if self.parts > 1:
            name += f"-p{self.parts}"
        if self.chunks > 1:
            name += f"-c{self.chunks}"
        return name

    def path(self, root: Path, world_size: int) -> Path:
        return root / self.collective.value / f"{self.variant}.w{world_size}.txt"

    def text(self, world_size: int) -> str:
        return render(build(self.collective, world_size, algorithm=self.algorithm, parts=self.parts, chunks=self.chunks))


def entries() -> list[Entry]:
    """Every variant in the catalog: each algorithm, ring with 2 parts, sliced with 2 and 4 chunks."""
    out = []
    for collective, algorithms in ALGORITHMS.items():
        for algorithm in algorithms:
            if algorithm is Algorithm.SLICED:
                out += [Entry(collective, algorithm, chunks=2), Entry(collective, algorithm, chunks=4)]
            else:
                out.append(Entry(collective, algorithm))
            if algorithm is Algorithm.RING:
                out.append(Entry(collective, algorithm, parts=2))
    return out


def files() -> dict[str, str]:
    """Relative path -> expected content, for the whole catalog."""
    return {
        str(e.path(Path(), n)): e.text(n) for e in entries() for n in WORLD_SIZES
    }


def dump(root: Path) -> list[Path]:
    """Write every table under ``root``; returns the files that changed."""
    changed = []
    for rel, text in files().items():
        path = root / rel
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def check(root: Path) -> list[str]:
    """Relative paths whose file is missing or differs from the builder's output."""
    return [rel for rel, text in files().items() if not (root / rel).exists() or (root / rel).read_text() != text]
