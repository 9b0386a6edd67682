"""Tier (b): the README's examples run as written, under torchrun on gloo ranks (CPU)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(ranks: int, script: str, *args: str) -> str:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.fail("torchrun is not installed next to this Python: the example cannot be run as the README says")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(ranks), str(ROOT / "examples" / script),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"examples/{script} failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return done.stdout


def test_tp_mlp_example_runs_under_torchrun():
    out = _torchrun(2, "tp_mlp.py")
    for rank in (0, 1):
        assert f"rank {rank}: y (4, 256, 1024)" in out, out


@pytest.mark.parametrize("plan", ("torch", "commfuse"))
def test_llama_block_example_trains_under_torchrun(plan):
    out = _torchrun(4, "llama_block.py", "--tp", "2", "--plan", plan, "--steps", "2")
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("loss" in line and "grad norm" in line for line in steps), out


def test_moe_example_trains_under_torchrun():
    out = _torchrun(2, "moe.py")
    for rank in (0, 1):  # the two ranks' lines may interleave in the captured output: match, don't split
        steps = re.findall(rf"rank {rank}: step (\d) y \(2, 64, 256\) loss \d", out)
        assert steps == ["0", "1", "2"], out
