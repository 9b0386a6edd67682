"""Tier (a), no processes: README.md stays true to the code: its tables name every ``COMMFUSE_*`` variable the
code reads, those for users apart from those of the CI scripts and those commfuse sets for itself, and its model
example is the file it says it quotes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: A variable's name, not a part of a longer identifier (``_COMMFUSE_ERRORS`` in the suite is a tuple of names).
NAME = re.compile(r"(?<![A-Za-z0-9_])COMMFUSE_[A-Z0-9_]+(?![A-Za-z0-9_])")
#: Where code that reads variables lives: the package, the vendor backends, the CI and benchmark scripts.
CODE_ROOTS = ("commfuse", "backends", "ci", ".ci", "benchmarks")


def _code_files():
    for top in CODE_ROOTS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT)
            if not path.is_file() or "tests" in rel.parts or "__pycache__" in rel.parts:
                continue
            if path.suffix in (".py", ".sh") or (path.suffix == "" and path.read_bytes().startswith(b"#!")):
                yield path


def names_in_code() -> dict[str, list[str]]:
    """Every ``COMMFUSE_*`` name the code files mention, with the files that mention it."""
    found: dict[str, list[str]] = {}
    for path in _code_files():
        for name in set(NAME.findall(path.read_text(errors="replace"))):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def table_variables() -> dict[str, list[str]]:
    """The environment-variable table: first-column name -> the other cells."""
    rows = {}
    for line in readme_section("Environment variables").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(COMMFUSE_[A-Z0-9_]+)`", cells[0]) if line.startswith("|") else None
        if m:
            assert m.group(1) not in rows, f"README's table lists {m.group(1)} twice"
            rows[m.group(1)] = cells[1:]
    return rows


#: The tables of README's "Environment variables", by their ``###`` titles: for users, for the CI scripts, and
#: those commfuse sets for a copy of itself.
USERS, CI, INTERNAL = "For your program and the command", "For the scripts in `ci/`", "Set by commfuse itself"


def tables() -> dict[str, set[str]]:
    """``###`` title -> the variables of its table."""
    parts = re.split(r"^### (.+)$", readme_section("Environment variables"), flags=re.MULTILINE)
    return {title: set(re.findall(r"^\| `(COMMFUSE_[A-Z0-9_]+)` \|", body, flags=re.MULTILINE))
            for title, body in zip(parts[1::2], parts[2::2])}


def test_readme_keeps_user_variables_apart_from_ci_and_internal_ones():
    found, by_table = names_in_code(), tables()
    assert list(by_table) == [USERS, CI, INTERNAL], list(by_table)
    assert all(by_table.values()), by_table
    for name in found:
        holding = [title for title, names in by_table.items() if name in names]
        assert len(holding) == 1, f"{name} must be in exactly one of README's tables, is in {holding}"
    # the CI scripts' table: exactly the variables only the scripts in ci/ (and .ci/) read
    only_ci = {name for name, files in found.items() if all(f.split("/")[0] in ("ci", ".ci") for f in files)}
    assert by_table[CI] == only_ci, f"ci/'s variables: {sorted(only_ci)}; README's table: {sorted(by_table[CI])}"
    # what users set says nothing of not being for them
    users = readme_section("Environment variables").split(f"### {USERS}", 1)[1].split("### ", 1)[0]
    assert "not for users" not in users.lower()


def test_the_scan_finds_variables_the_code_is_known_to_read():
    found = names_in_code()
    # one from the library, one from a vendor backend, one from a CI script: the scan reaches all three
    assert {"COMMFUSE_TIMEOUT_S", "COMMFUSE_CUDA_NATIVE", "COMMFUSE_VENV"} <= set(found), sorted(found)
    assert "COMMFUSE_ERRORS" not in found  # a Python name that only ends in one


def test_readme_table_names_every_variable_the_code_reads():
    found, table = names_in_code(), table_variables()
    missing = {name: files for name, files in found.items() if name not in table}
    assert not missing, (
        "README.md's 'Environment variables' table lacks: "
        + "; ".join(f"{name} (read in {', '.join(files)})" for name, files in sorted(missing.items()))
    )
    stale = sorted(set(table) - set(found))
    assert not stale, f"README.md's table lists variables no code reads any more: {stale}"
    for name, cells in table.items():
        assert len(cells) == 3 and all(cells), f"README.md's row for {name} must fill every column: {cells}"


def test_readme_model_example_is_the_file_it_quotes():
    section = readme_section("Use it in your model")
    assert "examples/tp_mlp.py" in section
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, f"expected one python block in 'Use it in your model', found {len(blocks)}"
    source = (ROOT / "examples" / "tp_mlp.py").read_text()
    assert blocks[0] in source, "README's example differs from examples/tp_mlp.py: quote the file again"
    assert "from commfuse.tp import ColwiseParallel, RowwiseParallel" in blocks[0]
    compile(source, "examples/tp_mlp.py", "exec")  # it parses (running it needs torchrun and commfuse.tp)
