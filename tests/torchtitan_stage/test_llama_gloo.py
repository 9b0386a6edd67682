"""torchtitan 0.3's own Llama 3 on gloo ranks: its stock tensor-parallel plan against the same model built with
commfuse's modules through ``commfuse.integrations.torchtitan`` (one call on the model config), five AdamW steps
with clipping side by side (``_llama_cases``). Runs in the torchtitan environment (``ci/test_torchtitan.sh``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _llama_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(n: int, dp: int, separate_qkv: bool, algorithm: str, query_split: bool, core: str,
             ac: str = "none") -> list[dict]:
    return launch(_llama_cases.training, n, dp, separate_qkv, algorithm, query_split, core, ac, timeout=600)


@pytest.mark.parametrize(("n", "dp", "separate_qkv", "algorithm", "query_split", "core"), [
    (4, 1, False, "ring", True, "sdpa"),    # tp4, the fused wqkv every llama3 config uses; attention split by query
    (4, 1, False, "ring", False, "sdpa"),   # the same with torchtitan's attention core whole between the projections
    (4, 1, False, "vanilla", True, "sdpa"),
    (4, 1, True, "auto", True, "sdpa"),     # wq, wk, wv apart: one gather feeds all three
    (2, 1, False, "auto", True, "sdpa"),
    (2, 1, False, "ring", True, "flex"),    # FlexAttention, packed documents' BlockMask: forward only (no CPU backward)
    (4, 2, False, "ring", True, "sdpa"),    # dp2 x tp2 with FSDP2
    (4, 2, True, "vanilla", False, "sdpa"),
])
def test_torchtitan_llama3_trains_as_its_stock_tp_plan(n, dp, separate_qkv, algorithm, query_split, core):
    results = _results(n, dp, separate_qkv, algorithm, query_split, core)
    errors = {r: e for r, res in enumerate(results) for e in res.values() if e}
    assert len(results) == n and all(len(res) == 1 for res in results), results
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@pytest.mark.parametrize("ac", ("full", "selective", "selective+commfuse"))
def test_torchtitan_activation_checkpointing_trains_as_its_stock_tp_plan(ac):
    """torchtitan's own FullAC and SelectiveAC applied to both models (tp2, the fused wqkv, the query-split
    attention): the same five steps, losses, norms and gradients as the stock model under the same policy."""
    results = _results(2, 1, False, "ring", True, "sdpa", ac)
    errors = {r: e for r, res in enumerate(results) for e in res.values() if e}
    assert len(results) == 2 and all(len(res) == 1 for res in results), results
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
