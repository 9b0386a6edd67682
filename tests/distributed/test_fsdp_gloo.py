"""Tier (b), real gloo ranks: commfuse's ShardedLinear under FSDP2 (fully_shard) against the unsharded model:
commfuse.fsdp.fully_shard leaves its parameters to it, torch's fully_shard alone never gives wrong gradients,
and clip_grad_norm_ is the whole model's norm on every rank; gradient accumulation without reduction (no_sync) and
FSDP2's mixed-precision policy reach ShardedLinear too."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(n: int) -> list[dict]:
    return launch(_fsdp_cases.with_fully_shard, n, timeout=600)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("commfuse-fully-shard", "torch-fully-shard", "reregistered",
                                  "gradient-accumulation", "mixed-precision"))
def test_sharded_linear_under_fully_shard(n, name):
    errors = {r: res.get(name, "did not run") for r, res in enumerate(_results(n)) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
