"""Blocks cut into stages for ``commfuse.strands``: what the two-strand tests, the ``strands`` bench workload
and docs/strands.md run.

:func:`llama_tp_stages` is a Llama-style block under commfuse's tensor parallelism with sequence
parallelism (activations sharded along the sequence, dim 1), in five stages:

========================== ==================================== ===========================================
stage                      forward                              transfers
========================== ==================================== ===========================================
gather + QKV               ``AG(x) @ wqkv``                     all-gather ring (backward: reduce-scatter)
attention core             causal SDPA per head                 none
out-proj + reduce-scatter  ``x + RS(o @ wo)``                   reduce-scatter ring (backward: all-gather)
gather + w1/w3             ``silu(AG(h) @ w1) * (AG(h) @ w3)``  all-gather ring, one gather for both
w2 + reduce-scatter        ``h + RS(u @ w2)``                   reduce-scatter ring
========================== ==================================== ===========================================

Norms are left out (they change no transfer). Each stage passes on what a later stage needs (the residual)
in its output tuple.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import commfuse.ops as ops
from commfuse.fused.attention import attend
from commfuse.strands import Stage

__all__ = ["llama_tp_params", "llama_tp_stages"]

LLAMA_STAGES = ("gather + QKV", "attention core", "out-proj + reduce-scatter", "gather + w1/w3",
                "w2 + reduce-scatter")


def llama_tp_params(rank: int, n: int, *, hidden: int, ffn: int, seed: int = 7, dtype=torch.float32) -> dict:
    """This rank's shards of the block's weights (``wqkv`` columns by head group, ``wo`` rows, ``w1``/``w3``
    columns, ``w2`` rows), cut from full weights drawn from ``seed``: every world size sees one model."""
    g = torch.Generator().manual_seed(seed)
    full = {"wqkv": torch.randn(hidden, 3 * hidden, generator=g) / hidden ** 0.5,
            "wo": torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
            "w1": torch.randn(hidden, ffn, generator=g) / hidden ** 0.5,
            "w3": torch.randn(hidden, ffn, generator=g) / hidden ** 0.5,
            "w2": torch.randn(ffn, hidden, generator=g) / ffn ** 0.5}
    q, k, v = full["wqkv"].chunk(3, dim=1)
    out = {"wqkv": torch.cat([t.chunk(n, dim=1)[rank] for t in (q, k, v)], dim=1),
           "wo": full["wo"].chunk(n, dim=0)[rank], "w1": full["w1"].chunk(n, dim=1)[rank],
           "w3": full["w3"].chunk(n, dim=1)[rank], "w2": full["w2"].chunk(n, dim=0)[rank]}
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def llama_tp_stages(params: dict, *, heads: int, algorithm: str = "ring", group=None,
                    figures: dict | None = None) -> list[Stage]:
    """The block's five stages over ``params`` (:func:`llama_tp_params`: this rank's shards; ``heads`` is this
    rank's head count times the world size). ``figures``: stage name -> ``(compute, comm)`` seconds of the
    forward, for the plan search (``commfuse.strands.profile`` measures them)."""
    p = params
    d = p["wo"].shape[1] // heads

    def qkv(x):
        return ops.all_gather_matmul(x, p["wqkv"], gather_dim=1, algorithm=algorithm, group=group), x

    def core(qkv, x):
        b, s = qkv.shape[:2]
        q, k, v = (t.reshape(b, s, -1, d) for t in qkv.chunk(3, dim=-1))
        return attend(q, k, v, causal=True).reshape(b, s, -1), x

    def out(o, x):
        return (x + ops.matmul_reduce_scatter(o, p["wo"], scatter_dim=1, algorithm=algorithm, group=group),)

    def up(h):
        a, b = ops.all_gather_matmul(h, [p["w1"], p["w3"]], gather_dim=1, algorithm=algorithm, group=group)
        return F.silu(a) * b, h

    def down(u, h):
        return h + ops.matmul_reduce_scatter(u, p["w2"], scatter_dim=1, algorithm=algorithm, group=group)

    fns = dict(zip(LLAMA_STAGES, (qkv, core, out, up, down)))
    if figures is None:
        return [Stage(name, fn) for name, fn in fns.items()]
    return [Stage(name, fn, *figures[name]) for name, fn in fns.items()]
