"""Tier (b), real gloo ranks: commfuse.tp's styles against torch's, side by side in each rank.

Every case parallelizes the same model twice (torch's ColwiseParallel /
RowwiseParallel and commfuse's) and checks outputs, every gradient, the
clipped gradient norm (equal on every rank), AdamW steps and state dicts.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _tp_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int) -> list[dict]:
    return launch(getattr(_tp_cases, body), n, timeout=600)


def _check(body: str, n: int, name: str) -> None:
    errors = {r: res.get(name, "did not run") for r, res in enumerate(_results(body, n)) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("algorithm", ("ring", "vanilla", "auto"))
def test_sequence_parallel_mlp_trains_as_torch_styles_do(n, algorithm):
    _check("sequence_parallel_mlp", n, f"sp-mlp-{algorithm}")


@pytest.mark.parametrize("name", ("replicated-in-replicated-out", "dtensor-out", "batch-dim-no-bias",
                                  "uneven-dtensor-in"))
def test_other_layouts_match_torch_styles(name):
    _check("layouts", 2, name)


@pytest.mark.parametrize("name", ("dtensor-to-functional-op", "wrong-module-or-layout", "debug-log-of-a-fallback"))
def test_errors_and_log(name):
    _check("errors_and_log", 2, name)


@pytest.mark.parametrize("name", ("tp-then-fully-shard", "nn-mlp-under-fully-shard"))
def test_tp_then_fully_shard_on_a_2x2_mesh(name):
    _check("with_fsdp", 4, name)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("clip-norm-and-state-dict", "uneven-refused"))
def test_nn_layers_hold_dtensor_parameters(n, name):
    _check("nn_layers", n, name)


@pytest.mark.parametrize("name", ("block-styles-replicated-out", "block-styles-errors",
                                  "attention-auto-computes-each-slice-once"))
def test_block_styles(name):
    _check("block_styles", 2, name)


@pytest.mark.parametrize("name", ("dotted-projection-names", "fused-qkv", "refused-by-name", "dtensor-residual"))
def test_block_styles_on_torchtitan_shapes(name):
    _check("torchtitan_shapes", 2, name)
