"""A Llama-style transformer block and its two tensor-parallel plans: torch's styles and commfuse's.

The reference block of the Llama tests, the ``llama_block`` bench workload and
examples/llama_block.py.

The block: RMSNorm, causal self-attention with rotary embeddings (RoPE) and
grouped-query attention (GQA), RMSNorm, a SwiGLU feed-forward, two residuals.
Written as torchtitan writes it, so that both plans below apply unchanged:

- ``torch_plan()``: torch's ``ColwiseParallel`` / ``RowwiseParallel`` with
  ``SequenceParallel`` norms; the activations are gathered and scattered by
  separate collectives;
- ``commfuse_plan()``: the same layouts through ``commfuse.tp``: one gather
  feeds Q, K and V, one gather feeds the two up projections, and the
  reduce-scatters are fused with the attention slices and the down projection.

examples/llama_block.py trains it under torchrun on a dp x tp mesh with FSDP2.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def rope_cache(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the rotary angles, each (seq_len, head_dim / 2)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(q: torch.Tensor, k: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (batch, seq, heads, head_dim) rotated by position: each half of a head's features pairs with the
    other half (the rotate-half form)."""
    cos, sin = cache
    cos, sin = cos[None, : q.shape[1], None, :], sin[None, : q.shape[1], None, :]

    def rotate(t):
        a, b = t.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    return rotate(q), rotate(k)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.wq(x).view(b, s, -1, d), self.wk(x).view(b, s, -1, d), self.wv(x).view(b, s, -1, d)
        q, k = apply_rope(q, k, cache)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # grouped-query: heads share keys and values
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 64) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cache)
        return h + self.feed_forward(self.ffn_norm(h))


def torch_plan() -> dict:
    """torchtitan's plan for the block: sequence-parallel norms, the activations gathered before attention and
    the feed-forward, reduce-scattered after them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def commfuse_plan(head_dim: int = 8, algorithm: str = "auto") -> dict:
    """The same layouts with commfuse's block styles: every collective fused with the compute that needs it."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from commfuse.tp import AttentionParallel, SwiGLUParallel

    return {
        "attention_norm": SequenceParallel(),
        "attention": AttentionParallel(head_dim=head_dim, rope=apply_rope, algorithm=algorithm),
        "ffn_norm": SequenceParallel(),
        "feed_forward": SwiGLUParallel(algorithm=algorithm),
    }
