"""Tier (a), no processes: what the block styles check before they take a block over.

The helpers that read a block (``commfuse.nn._blocks``: which activation a module computes, whether a norm is
per head, which parts no claimed submodule holds), the attention core's soft-cap and sliding window against
the plain math, and the refusals, by name, of hand-made blocks that hold something the styles do not compute
(applied on torch's fake process group, in a process of its own, so that its group never meets this one's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from commfuse.fused.attention import attend
from commfuse.nn._blocks import activation_name, per_head, unclaimed


class _QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


def test_an_activation_is_told_by_what_it_computes():
    assert activation_name(nn.SiLU()) == "silu"
    assert activation_name(nn.GELU()) == "gelu"
    assert activation_name(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert activation_name(nn.ReLU()) == "relu"
    assert activation_name(_QuickGELU()) is None
    assert activation_name(nn.PReLU()) is None  # it holds a parameter
    assert activation_name(nn.Linear(2, 2)) is None


def test_transformers_activations_are_told_apart():
    activations = pytest.importorskip("transformers.activations")
    names = {key: activation_name(activations.ACT2FN[key]) for key in
             ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "quick_gelu", "relu2", "gelu_10")}
    assert names == {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                     "relu": "relu", "quick_gelu": None, "relu2": None, "gelu_10": None}


def test_a_norm_is_per_head_when_its_tensors_are_one_heads_features():
    assert per_head(nn.RMSNorm(8), 8) and per_head(nn.LayerNorm(8), 8)
    assert not per_head(nn.RMSNorm(32), 8)  # OLMo 2's: every head's features at once
    assert not per_head(nn.LayerNorm([4, 8]), 8)


def test_unclaimed_parts_are_named():
    block = nn.Module()
    block.wq, block.wo = nn.Linear(4, 4), nn.Linear(4, 4)
    block.off = nn.Dropout(0.0)
    block.same = nn.Identity()
    assert unclaimed(block, ["wq", "wo"]) == []
    block.drop = nn.Dropout(0.1)
    block.gate = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    block.sink = nn.Parameter(torch.zeros(2))
    block.register_buffer("table", torch.zeros(3))
    assert unclaimed(block, ["wq", "wo"]) == ["'drop' (a Dropout with p=0.1)", "'gate' (a Sequential)",
                                             "'sink' (a parameter of the block itself)",
                                             "'table' (a buffer of the block itself)"]
    # a container of claimed projections passes, a parameter of its own does not
    holder = nn.Module()
    holder.qkv = nn.Module()
    holder.qkv.wq = nn.Linear(4, 4)
    holder.qkv.scale = nn.Parameter(torch.ones(1))
    assert unclaimed(holder, ["qkv.wq"]) == ["'qkv.scale' (a parameter of the Module that holds the projections)"]
    # a rope hook given the block reads its modules without parameters and its buffers
    rope = nn.Module()
    rope.register_buffer("cos", torch.zeros(3))
    block2 = nn.Module()
    block2.wq, block2.rope = nn.Linear(4, 4), rope
    assert unclaimed(block2, ["wq"]) == ["'rope' (a Module)"]
    assert unclaimed(block2, ["wq"], hook_reads_block=True) == []


def _plain(q, k, v, *, scale, softcap=None, window=None):
    """The math, written out: (b, L, H, d) heads, causal, a window of keys, a soft-cap."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[1])[:, None]
    j = torch.arange(k.shape[1])[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= i - j < window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


@pytest.mark.parametrize("softcap", (None, 2.0))
@pytest.mark.parametrize("window", (None, 3))
def test_attend_soft_caps_and_slides_as_the_math_says(softcap, window):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 2, 4, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    got = attend(q, k, v, causal=True, scale=0.3, softcap=softcap, window=window)
    torch.testing.assert_close(got, _plain(q, k, v, scale=0.3, softcap=softcap, window=window))
    # a query slice (rows 3..6) against the keys it may see, as the query-split ring computes it
    part = attend(q[:, 3:6], k[:, :6], v[:, :6], causal=True, q_offset=3, scale=0.3, softcap=softcap, window=window)
    torch.testing.assert_close(part, got[:, 3:6])


def _refusals() -> dict:
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("_block_style_checks_cases.py"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


REFUSED = {
    "extra linear": ("AttentionParallel", "Attention holds 'gate' (a Linear)", "'wq': ColwiseParallel()",
                     "'wo': RowwiseParallel()"),
    "dropout": ("'attn_dropout' (a Dropout with p=0.1)",),
    "block parameter": ("'sinks' (a parameter of the block itself)",),
    "norm over all heads": ("query norm 'q_norm'", "weight [16]", "one head of 4 features"),
    "norm not named": ("'q_norm' (a RMSNorm)", "q_norm= and k_norm="),
    "unknown activation": ("SwiGLUParallel", "the activation 'act' (QuickGELU)", "none of the activations"),
    "geglu taken for swiglu": ("GeGLU's own forward differs", "activation 'silu'", "'w1': ColwiseParallel()"),
    "nested path": ("'layers.0.feed_forward' (FeedForward)", "'norm' (a LayerNorm)"),
    "ring attention extra part": ("RingAttentionParallel", "'extra' (a Linear)", "context_parallel"),
}


def test_hand_made_blocks_are_refused_by_name_when_applied():
    got = _refusals()
    assert set(got) == set(REFUSED)
    for case, words in REFUSED.items():
        assert got[case].startswith("CommfuseValueError: "), (case, got[case])
        missing = [w for w in words if w not in got[case]]
        assert not missing, f"{case}: the error does not say {missing}: {got[case]}"
