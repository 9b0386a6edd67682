"""Tier (b), real gloo ranks: attention masks in the query-split attention. commfuse.nn.ParallelAttention and
commfuse.tp.AttentionParallel take causal + additive, boolean and document masks (document ids, cumulative
lengths, torchtitan's VarlenMetadata, FlexAttention's BlockMask), each query slice of the reduce-scatter ring
taking its rows of the mask and its keys' columns, and equal the unsharded attention computed by plain
scaled_dot_product_attention with the same mask, forward and backward, eager and compiled; an argument that is
not a mask and that no rope hook takes is refused by name, never ignored."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _masks_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

MASKS = ("additive", "additive-per-head", "boolean", "document-ids", "cu-seqlens", "varlen-metadata", "block-mask")


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int, *args) -> list[dict]:
    return launch(getattr(cases, body), n, *args, timeout=900)


def _check(body: str, n: int, name: str, *args) -> None:
    results = _results(body, n, *args)
    errors = {r: res.get(name, "did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("algorithm", ("ring", "vanilla"))
@pytest.mark.parametrize("causal", ("causal", "full"))
@pytest.mark.parametrize("mask", MASKS)
def test_parallel_attention_honours_the_mask_in_every_query_slice(mask, causal, algorithm, n):
    _check("parallel_attention", n, f"{mask}-{causal}-{algorithm}")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("causal", ("causal", "full"))
@pytest.mark.parametrize("how,mask", [("titan", m) for m in MASKS if m not in ("document-ids", "cu-seqlens")]
                         + [("keyword", m) for m in MASKS])
def test_attention_parallel_honours_the_block_mask_argument(how, mask, causal, n):
    _check("attention_parallel", n, f"{mask}-{causal}-{how}")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("no-rope-for-an-argument", "rope-does-not-take-it", "dict-of-masks",
                                  "integer-mask", "sharded-mask", "mask-with-gradient", "two-masks",
                                  "document-across-batch-rows", "one-rank-refused"))
def test_what_is_not_a_mask_is_refused_by_name(name, n):
    _check("refusals", n, name)


@pytest.mark.parametrize("backend", ("aot_eager", "inductor"))
@pytest.mark.parametrize("layer", ("ParallelAttention", "AttentionParallel"))
@pytest.mark.parametrize("mask", ("additive-per-head", "boolean", "document-ids", "block-mask"))
def test_masked_attention_compiles_to_one_graph_and_equals_eager(mask, layer, backend):
    _check("compiled", 2, f"{layer}-{mask}", backend)
