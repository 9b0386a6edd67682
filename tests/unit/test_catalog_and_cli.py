"""Tier (a), no processes: the schedules/ catalog matches the builders, and the CLI works."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from commfuse import __version__
from commfuse.cli import main
from commfuse.schedule import _catalog, build, render

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "schedules"


@pytest.mark.parametrize("rel", sorted(_catalog.files()))
def test_catalog_file_matches_builder(rel):
    path = CATALOG / rel
    assert path.exists(), f"{rel} is missing: run `commfuse schedule dump`"
    assert path.read_text() == _catalog.files()[rel], f"{rel} differs from the builder: run `commfuse schedule dump`"


def test_catalog_covers_every_collective_algorithm_and_world_size():
    from commfuse.schedule import ALGORITHMS

    names = {Path(rel).parts[0] + "/" + Path(rel).name for rel in _catalog.files()}
    for collective, algorithms in ALGORITHMS.items():
        assert (CATALOG / collective.value / "README.md").exists()
        for algorithm in algorithms:
            for n in _catalog.WORLD_SIZES:
                assert any(
                    name.startswith(f"{collective.value}/{algorithm.value}") and name.endswith(f".w{n}.txt")
                    for name in names
                )


def test_dump_check_detects_a_stale_file(tmp_path, capsys):
    assert main(["schedule", "dump", "--dir", str(tmp_path)]) == 0
    assert main(["schedule", "dump", "--dir", str(tmp_path), "--check"]) == 0
    victim = tmp_path / "all_gather" / "ring.w4.txt"
    victim.write_text(victim.read_text().replace("C(1)", "C(2)", 1))
    assert main(["schedule", "dump", "--dir", str(tmp_path), "--check"]) == 1
    assert "all_gather/ring.w4.txt" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "reduce_scatter")
    assert main(["schedule", "dump", "--dir", str(tmp_path)]) == 0
    assert main(["schedule", "dump", "--dir", str(tmp_path), "--check"]) == 0


def test_schedule_show_prints_the_table(capsys):
    assert main(["schedule", "show", "all_gather", "--world-size", "4", "--algorithm", "ring"]) == 0
    out = capsys.readouterr().out
    assert out == render(build("all_gather", 4, algorithm="ring"))
    assert "S(0)->1 R(3)<-3 C(0)" in out


def test_schedule_show_bad_value_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as e:  # refused as the arguments are parsed
        main(["schedule", "show", "all_gather", "--world-size", "0"])
    assert e.value.code == 2
    assert "argument --world-size/-n: expected an integer from 1 to 64, got '0'" in capsys.readouterr().err
    assert main(["schedule", "show", "all_to_all", "-n", "4", "-a", "bidirectional"]) == 2
    assert "'bidirectional' is not defined for all_to_all" in capsys.readouterr().err


def test_console_script_version_and_help():
    exe = shutil.which("commfuse", path=str(Path(sys.executable).parent))
    assert exe, "the commfuse console script is not installed next to this python"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"commfuse {__version__}"
    helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    assert "schedule" in helptext
    module = subprocess.run([sys.executable, "-m", "commfuse", "schedule", "show", "reduce_scatter", "-n", "3"],
                            capture_output=True, text=True, check=True)
    assert module.stdout == render(build("reduce_scatter", 3))
