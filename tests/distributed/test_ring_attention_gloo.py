"""Tier (b), real gloo ranks: ring attention (commfuse.ring_attention, commfuse.nn.RingAttention) on each rank's
sequence shard equals the unsharded attention in float64, forward and dq/dk/dv, on 2, 3 and 4 ranks, causal and
full, contiguous and zigzag, MHA and GQA, with and without documents, float32 and bfloat16, over the ring,
bidirectional, vanilla and auto algorithms; equals torch's own ring attention; its error does not grow with the
ring (8 ranks); the layer equals the unsharded layer eagerly and compiled; the 2-D form (Ulysses inside, ring
across) on a 2 x 2 mesh does too; commfuse.tp.RingAttentionParallel on a Llama-style block equals the unsharded
block; under bf16 autocast the op, the layer and the style match their unsharded runs; bad input is refused by
name."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _ring_attention_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int) -> list[dict]:
    return launch(getattr(cases, body), n, timeout=600)


def _check(body: str, n: int, prefix: str = "") -> None:
    results = _results(body, n)
    assert results[0], "no check ran"
    errors = {(r, name): e for r, res in enumerate(results) for name, e in res.items()
              if name.startswith(prefix) and e}
    assert not errors, "\n".join(f"rank {r}, {name}: {e}" for (r, name), e in errors.items())


@pytest.mark.parametrize("n", (2, 3, 4))
@pytest.mark.parametrize("layout", ("contiguous", "zigzag"))
def test_ring_attention_equals_unsharded_attention_forward_and_backward(layout, n):
    """32 cases per world size (layout x causal x MHA/GQA x documents x dtype, algorithms in turn): output, dq,
    dk, dv of every rank's shard against float64 SDPA on the whole sequence."""
    _check("numerics", n, layout)


@pytest.mark.parametrize("n", (2, 3, 4))
def test_ring_attention_equals_torch_ring_attention(n):
    """Forward against torch's ring (its public context_parallel cannot run on CPU: see the case's docstring);
    skipped by capability, with the reason, where this torch has no such ring to call."""
    why = _results("numerics", n)[0].get("skip:torch-ring-attention")
    if why:
        pytest.skip(why)
    _check("numerics", n, "torch-ring-attention")


def test_ring_attention_layer_eager_and_compiled_and_refusals():
    """RingAttention (zigzag, GQA, RoPE, documents) equals the unsharded layer, its input and weight gradients
    too; torch.compile(layer) runs (graph break) and equals eager, fullgraph=True refuses with the reason; shape
    mismatches, Hq not a multiple of Hkv, a zigzag shard that does not cut, document lengths that do not sum,
    an unknown layout are refused naming the rank and sizes, and the group stays in step."""
    _check("layer_and_refusals", 2)


def test_two_dimensional_ulysses_inside_ring_across():
    """A 2 x 2 cp x ulysses mesh: ring attention with Ulysses inside (contiguous and zigzag; causal, documents,
    full; float32 and bfloat16; ring, vanilla, bidirectional) equals float64 attention forward and dq/dk/dv;
    RingAttention with a Ulysses group equals the unsharded layer (weight gradients summed over the mesh);
    K/V heads that do not divide by the Ulysses group's size are refused by name."""
    _check("two_dimensional", 4)


@pytest.mark.parametrize("n", (2, 3))
def test_ring_attention_parallel_style_equals_unsharded_block(n):
    """commfuse.tp.RingAttentionParallel applied with parallelize_module(block, mesh["cp"], style) to
    commfuse.models.llama's attention block (GQA, RoPE by a hook indexing the block's whole-sequence cache by
    this rank's positions), contiguous and zigzag, and to torchtitan's shape (fused wqkv, its RoPE module via
    rope_takes_module), equals the unsharded block on the whole sequence in float64: output, input gradient and
    every weight gradient (summed over the cp ranks by the style); documents via document_lengths=; with DDP
    over the cp group, sum_grads=False gives DDP's average and sum_grads=True the style's sum unchanged, and
    the same with torch's fully_shard (FSDP2) applied after the style over the cp ranks (its reduce-scattered
    Shard(0) gradients, gathered, against the whole block's); a rope hook without positions=, masks other than documents, the block's own positions, a Replicate() DTensor
    input and a zigzag shard that does not cut are refused by name, and the group stays in step."""
    _check("style", n)


@pytest.mark.parametrize("n", (2, 3))
def test_ring_attention_under_bf16_autocast(n):
    """Under torch.autocast("cpu", dtype=torch.bfloat16): commfuse.ring_attention on float32 inputs equals it on
    bfloat16 inputs outside autocast bit for bit (output bfloat16, merged in float32), dq/dk/dv too;
    commfuse.nn.RingAttention and RingAttentionParallel on a Llama block equal the unsharded layer or block under
    autocast within 3e-2 of the largest value (8 bf16 ulps), output, input and weight gradients."""
    _check("autocast", n)


@pytest.mark.slow
def test_ring_attention_error_does_not_grow_with_the_ring():
    """Causal zigzag ring at 2 and 8 ranks against float64: the max error at 8 is within 4x the error at 2 and
    within an absolute bound from the dtype's eps (float32: 2**-23 * 32; bfloat16: its output rounding,
    2**-8 at values up to 2, plus a margin)."""
    two, eight = _results("error_growth", 2), _results("error_growth", 8)
    for dtype, bound in (("float32", 32 * 2.0**-23), ("bfloat16", 2 * 2.0**-8 + 2e-3)):
        e2, e8 = max(r[dtype] for r in two), max(r[dtype] for r in eight)
        assert e8 <= max(4 * e2, bound), f"{dtype}: error {e8:.3g} at 8 ranks, {e2:.3g} at 2"
        assert e8 <= bound, f"{dtype}: error {e8:.3g} at 8 ranks over the bound {bound:.3g}"
