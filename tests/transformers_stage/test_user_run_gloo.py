"""Tier (b), real gloo ranks: transformers models trained as a user trains them on a dp x tp mesh of 4 ranks
(2 x 2): commfuse's block styles over tp (its MoE for Qwen3-MoE's sparse block), FSDP2 over dp per decoder
layer and the root, activation checkpointing as transformers turns it on (non-reentrant). In float64 the losses
and every gradient of two AdamW steps equal the model's in one process on the mean of the dp ranks' losses;
under bf16 autocast a checkpoint saved by torch.distributed.checkpoint after one step, loaded into a model of
other weights, gives the unsaved model's next steps bit for bit."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _user_run_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

#: Qwen3-MoE: a dense layer and a sparse one, QK-norm; Phi-3: stacked projections, placed Replicate() on tp;
#: Gemma 3: tied embeddings, GELU-tanh, sliding and full layers, QK-norm
FAMILIES = ("qwen3_moe", "phi3", "gemma3")


@functools.lru_cache(maxsize=None)
def _runs(path: str) -> list[dict]:
    return launch(cases.user_runs, 4, FAMILIES, path, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _runs(str(tmp_path_factory.mktemp("dcp") / "checkpoint"))


@pytest.mark.parametrize("body", ("against_one_process", "checkpoint_round_trip"))
@pytest.mark.parametrize("name", FAMILIES)
def test_fsdp2_over_dp_and_commfuse_over_tp_with_activation_checkpointing(runs, name, body):
    for rank, results in enumerate(runs):
        problems = results[name, body]
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)
