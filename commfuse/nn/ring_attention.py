"""Attention under context parallelism: a Llama-style attention layer on this rank's sequence shard, with
K/V passed around the ring (``commfuse.ring_attention``, docs/ring_attention.md).

The input (b, L, hidden) is this rank's L positions of the sequence, cut as ``layout`` says
(``commfuse.context``); Q, K and V are projected locally, rotated (RoPE) by the tokens' global positions
(``commfuse.context.positions``), attended over the whole sequence by ring attention, and projected out.
Weights are replicated over the group: their gradients are summed over it, since each rank sees other
tokens (as ``UlyssesAttention``'s). Grouped-query: ``num_kv_heads`` K/V heads, and only those travel.

Under ``torch.compile`` (``fullgraph=False``) the projections compile and the ring attention runs eagerly at
a graph break (it consumes K/V blocks with a Python callable; see ``commfuse.ops.ring_attention``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import commfuse.ops as ops
from commfuse.context import check_layout, positions, rope
from commfuse.errors import CommfuseValueError
from commfuse.fused.ulysses import ulysses_positions
from commfuse.nn._common import algorithm_option, replicated_linear, resolve_group, site_forward, world
from commfuse.schedule import Collective

__all__ = ["RingAttention"]


class RingAttention(nn.Module):
    """Attention over a sequence sharded over ``group`` (context parallelism), K/V travelling around the ring.

    Input and output (b, L, hidden): this rank's L positions. ``layout``: "contiguous" or "zigzag" (how the
    sequence was cut: ``commfuse.context.shard_sequence``). ``rope_theta``: RoPE's base (None: no rotary
    embedding). ``forward(x, document_lengths=None)``: document lengths over the whole sequence, one list for
    every batch row or one per row (a query sees its own document only). ``ulysses_group`` (the 2-D form:
    Ulysses inside, ring across ``group``): x is this rank's piece of its cp rank's shard
    (``commfuse.fused.ulysses.ulysses_positions``)."""

    algorithm = algorithm_option(Collective.ALL_GATHER, Collective.REDUCE_SCATTER)

    def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: int | None = None, causal: bool = True,
                 layout: str = "contiguous", rope_theta: float | None = 10000.0, bias: bool = False, group=None,
                 algorithm: str = "auto", ulysses_group=None, device=None, dtype=None) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if hidden_size % num_heads:
            raise CommfuseValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if num_heads % num_kv_heads:
            raise CommfuseValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
        self.group = resolve_group(group)
        self.rank, self.world_size = world(self.group)
        self.ulysses_group = resolve_group(ulysses_group)
        self.ulysses_rank, self.ulysses_size = world(self.ulysses_group) if ulysses_group is not None else (0, 1)
        # the weights' gradients are summed over every rank that holds other tokens: the cp group, and the
        # Ulysses group in the 2-D form
        self._groups = (self.group,) if ulysses_group is None else (self.group, self.ulysses_group)
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.causal, self.layout, self.rope_theta = causal, check_layout(layout), rope_theta
        self.algorithm = algorithm
        kv = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, kv, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, kv, bias=bias, device=device, dtype=dtype)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"causal={self.causal}, layout={self.layout!r}")

    @site_forward
    def forward(self, x: torch.Tensor, document_lengths=None) -> torch.Tensor:
        b, length, _ = x.shape
        d = self.head_dim
        q = replicated_linear(self.q_proj, x, *self._groups).view(b, length, -1, d)
        k = replicated_linear(self.k_proj, x, *self._groups).view(b, length, -1, d)
        v = replicated_linear(self.v_proj, x, *self._groups).view(b, length, -1, d)
        if self.rope_theta is not None:
            if self.ulysses_size == 1:
                pos = positions(length * self.world_size, self.rank, self.world_size, self.layout, device=x.device)
            else:
                pos = ulysses_positions(length * self.world_size * self.ulysses_size, self.rank, self.world_size,
                                        self.ulysses_rank, self.ulysses_size, self.layout, device=x.device)
            q, k = rope(q, pos, self.rope_theta), rope(k, pos, self.rope_theta)
        o = ops.ring_attention(q, k, v, group=self.group, causal=self.causal, layout=self.layout,
                               algorithm=self.algorithm, document_lengths=document_lengths,
                               ulysses_group=self.ulysses_group)
        return replicated_linear(self.o_proj, o.reshape(b, length, -1), *self._groups)

    @classmethod
    def from_linears(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear, *,
                     num_heads: int, num_kv_heads: int | None = None, **options) -> "RingAttention":
        """A layer holding copies of the four projections (every rank holds all of them)."""
        w = q_proj.weight
        with torch.random.fork_rng(devices=[]):  # converting must not move the global RNG
            layer = cls(q_proj.in_features, num_heads, num_kv_heads=num_kv_heads, bias=q_proj.bias is not None,
                        device=w.device, dtype=w.dtype, **options)
        layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj = (copy.deepcopy(lin) for lin in
                                                                  (q_proj, k_proj, v_proj, o_proj))
        return layer
