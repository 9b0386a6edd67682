"""Tier (b): the README's example runs as written, under torchrun on 2 gloo ranks (CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tp_mlp_example_runs_under_torchrun():
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.fail("torchrun is not installed next to this Python: the example cannot be run as the README says")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "tp_mlp.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"examples/tp_mlp.py failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    for rank in (0, 1):
        assert f"rank {rank}: y (4, 256, 1024)" in done.stdout, done.stdout
