"""Run by tests/unit/test_block_style_checks.py in a process of its own: the block styles applied to hand-made
blocks on torch's fake process group (rank 0 of 2), each refused by name when it is applied, before any
parameter is distributed. Prints one JSON object: case -> the error (class and message), or "applied"."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse import tp


class Attention(nn.Module):
    def __init__(self, dim=16, heads=4, head_dim=4):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(dim, heads * head_dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)


class FeedForward(nn.Module):
    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeGLU(FeedForward):
    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


def cases(mesh):
    def extra_linear():
        block = Attention()
        block.gate = nn.Linear(16, 16)  # an output gate the style would not compute
        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4))

    def dropout():
        block = Attention()
        block.attn_dropout = nn.Dropout(0.1)
        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4))

    def block_parameter():
        block = Attention()
        block.sinks = nn.Parameter(torch.zeros(4))  # attention sinks: a parameter of the block itself
        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4))

    def norm_over_all_heads():
        block = Attention()
        block.q_norm, block.k_norm = nn.RMSNorm(16), nn.RMSNorm(16)  # OLMo 2's: over every head's features
        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4, q_norm="q_norm", k_norm="k_norm"))

    def norm_not_named():
        block = Attention()
        block.q_norm, block.k_norm = nn.RMSNorm(4), nn.RMSNorm(4)  # per head, but not given to the style
        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4))

    def unknown_activation():
        block = FeedForward()
        block.act = QuickGELU()
        parallelize_module(block, mesh, tp.SwiGLUParallel())

    def geglu_taken_for_swiglu():
        parallelize_module(GeGLU(), mesh, tp.SwiGLUParallel())  # its forward's gelu is in no module

    def nested_path():
        root = nn.Module()
        root.layers = nn.ModuleList([nn.Module()])
        root.layers[0].feed_forward = FeedForward()
        root.layers[0].feed_forward.norm = nn.LayerNorm(16)
        parallelize_module(root, mesh, {"layers.*.feed_forward": tp.SwiGLUParallel()})

    def ring_extra():
        block = Attention()
        block.extra = nn.Linear(16, 16)
        parallelize_module(block, mesh, tp.RingAttentionParallel(head_dim=4))

    return {"extra linear": extra_linear, "dropout": dropout, "block parameter": block_parameter,
            "norm over all heads": norm_over_all_heads, "norm not named": norm_not_named,
            "unknown activation": unknown_activation, "geglu taken for swiglu": geglu_taken_for_swiglu,
            "nested path": nested_path, "ring attention extra part": ring_extra}


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name, case in cases(mesh).items():
        try:
            case()
            out[name] = "applied"
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
