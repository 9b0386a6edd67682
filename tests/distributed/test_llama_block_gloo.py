"""Tier (b), 4 real gloo ranks: a Llama-style block (RMSNorm, attention with RoPE and GQA, SwiGLU) on a 2 x 2
(dp x tp) mesh with FSDP2 on dp, parallelized with torch's styles and with commfuse's: 20 AdamW steps with
clipping give the same losses, norms (equal on every rank) and parameters, and a checkpoint saved at tp=2
loads into the unsharded block with the same loss."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _llama_block_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(checkpoint_dir: str) -> list[dict]:
    return launch(_llama_block_cases.train_and_checkpoint, 4, checkpoint_dir, timeout=900)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("llama-dcp")))


@pytest.mark.parametrize("name", ("train", "checkpoint"))
def test_llama_block_matches_torch_styles(results, name):
    errors = {r: res.get(name, "did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
