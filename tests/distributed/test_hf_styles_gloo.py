"""Tier (b), real gloo ranks: commfuse.tp's block styles on HuggingFace transformers modules.

Small models of ten kinds are built from configs (random weights, no hub); each layer's attention and MLP
module, parallelized by one plan with ``AttentionParallel()`` and ``SwiGLUParallel()`` (no arguments: read
from the modules) and called with what the model hands it, must give the unsharded module's output, input
gradient and every parameter gradient (fp32); the state dict and a distributed checkpoint must hold the
block's own whole tensors. What the styles do not compute is refused by name, before anything is sent, and a
rank that refuses alone is named on every rank.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
import _hf_styles_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int, *args) -> list[dict]:
    return launch(getattr(cases, body), n, *args, timeout=600)


def _check(results: list[dict]) -> None:
    errors = {(r, name): e for r, res in enumerate(results) for name, e in res.items() if e}
    assert results and all(results), results
    assert not errors, "\n".join(f"rank {r}, {name}: {e}" for (r, name), e in errors.items())


@pytest.mark.parametrize("family", sorted(cases.FAMILIES))
def test_block_styles_compute_what_the_transformers_modules_compute(family):
    _check(_results("compare_family", 2, family))


@pytest.mark.parametrize("family", ("qwen3", "gemma2", "phi3-gqa"))
def test_block_styles_on_three_ranks(family):
    _check(_results("compare_family", 3, family))


def test_phi3_fused_projections_checkpoint_their_true_rows(tmp_path):
    _check(launch(cases.phi3_checkpoint, 2, str(tmp_path / "ckpt"), timeout=600))


@pytest.mark.parametrize("name", ("olmo2 norm over all heads", "quick_gelu activation",
                                  "phi3 kv heads not whole per rank", "phi partial rotary", "kv cache", "window without a mask", "dropout in training", "other arguments",
                                  "hand-made kv_cache"))
def test_what_the_styles_do_not_compute_is_refused_by_name(name):
    errors = {r: res.get(name, "did not run") for r, res in enumerate(_results("refusals", 2)) if res.get(name, "-")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("warm", (False, True))
def test_a_cache_on_one_rank_is_named_on_every_rank(warm, n):
    out = launch(cases.one_rank_cache, n, warm, timeout=120, env={"COMMFUSE_TIMEOUT_S": "30"})
    kind, message, _ = out[-1]
    assert kind == "CommfuseValueError" and "KV cache" in message, out[-1]
    for rank, (kind, message, seconds) in enumerate(out[:-1]):
        assert kind == "PeerFailedError", f"rank {rank}: {kind}: {message}"
        assert f"rank {n - 1} left the call" in message and "KV cache" in message, message
        assert seconds < 15, f"rank {rank} was told after {seconds:.1f} s (the timeout is 30 s)"
