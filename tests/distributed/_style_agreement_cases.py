"""Rank-side bodies of the apply-time agreement: commfuse.tp's styles applied by ``parallelize_module`` to
modules that differ on one rank (an activation, an extra submodule, head counts, a width) or with arguments
that differ on one rank; what each rank raised, how long it took, and whether the group still works after."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import commfuse as cf
from commfuse import tp

DIM, HEAD_DIM = 16, 4


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class FeedForward(nn.Module):
    """``w2(act(w1(x)) * w3(x))``, with the activation a module of the block."""

    def __init__(self, hidden: int = 48, act: nn.Module | None = None):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, hidden, bias=False), nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)
        self.act = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Plain causal self-attention, ``heads`` heads of :data:`HEAD_DIM`."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = (nn.Linear(DIM, heads * HEAD_DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(heads * HEAD_DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, self.heads, HEAD_DIM).transpose(1, 2) for lin in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, heads: int, ffn: nn.Module):
        super().__init__()
        self.attention, self.feed_forward = Attention(heads), ffn


class Model(nn.Module):
    def __init__(self, heads: int = 4, ffn: nn.Module | None = None, proj: nn.Module | None = None):
        super().__init__()
        self.layers = nn.ModuleList([Layer(heads, ffn if ffn is not None else FeedForward())])
        self.proj = proj if proj is not None else nn.Linear(DIM, 2 * DIM)


def _block_plan(attention: dict | None = None, ffn: dict | None = None) -> dict:
    return {"layers.0.attention": tp.AttentionParallel(head_dim=HEAD_DIM, **(attention or {})),
            "layers.0.feed_forward": tp.SwiGLUParallel(**(ffn or {}))}


def _extra_gate(model: Model) -> Model:
    model.layers[0].attention.gate = nn.Linear(DIM, DIM)  # an output gate the style would not compute
    return model


def case(name: str, rank: int, n: int) -> tuple[nn.Module, dict]:
    """The model and plan of rank ``rank`` of ``n`` in case ``name``; the odd rank out is the last one."""
    odd = rank == n - 1
    heads = 2 * n
    if name == "happy":
        return Model(heads), _block_plan()
    if name == "activation refused":  # QuickGELU is none of the activations the style computes
        return Model(heads, FeedForward(act=QuickGELU() if odd else None)), _block_plan()
    if name == "activation differs":  # GELU is one it computes: nothing to refuse on that rank alone
        return Model(heads, FeedForward(act=nn.GELU() if odd else None)), _block_plan()
    if name == "extra submodule":
        model = Model(heads)
        return (_extra_gate(model) if odd else model), _block_plan()
    if name == "heads refused":  # one head more than splits evenly over the ranks
        return Model(heads + 1 if odd else heads), _block_plan()
    if name == "heads differ":  # twice the heads: they split evenly, and the ranks would scatter other shapes
        return Model(2 * heads if odd else heads), _block_plan()
    if name == "ffn width differs":  # 48 features on most ranks, 96 on the last (each splits evenly)
        return Model(heads, FeedForward(hidden=96 if odd else 48)), _block_plan()
    if name == "scale argument differs":
        return Model(heads), _block_plan(attention={"scale": 0.5} if odd else None)
    if name == "algorithm argument differs":
        return Model(heads), {"proj": tp.ColwiseParallel(algorithm="vanilla" if odd else "ring")}
    if name == "layout argument differs":
        return Model(heads), {"proj": tp.ColwiseParallel(input_layouts=Shard(1) if odd else Replicate())}
    if name == "not a linear":
        return Model(heads, proj=nn.Conv1d(DIM, DIM, 1) if odd else None), {"proj": tp.ColwiseParallel()}
    if name == "ring attention extra part":
        model = Model(heads)
        return (_extra_gate(model) if odd else model), {
            "layers.0.attention": tp.RingAttentionParallel(head_dim=HEAD_DIM)}
    if name == "all refuse alike":
        return _extra_gate(Model(heads)), _block_plan()
    if name == "all but the last refuse":
        model = Model(heads)
        return (model if odd else _extra_gate(model)), _block_plan()
    raise ValueError(name)


def _usable(mesh, rank: int, n: int) -> str | None:
    """A later plain commfuse call on the group, against the unsharded product: None, or what went wrong."""
    g = torch.Generator().manual_seed(5)
    whole, w = torch.randn(4 * n, 8, generator=g), torch.randn(8, 6, generator=g)
    try:
        got = cf.all_gather_matmul(whole.tensor_split(n)[rank], w, group=mesh.get_group(), algorithm="ring")
    except Exception as e:  # noqa: BLE001 - reported
        return f"the call after it raised {type(e).__name__}: {e}"
    if not torch.allclose(got, whole @ w, rtol=1e-5, atol=1e-6):
        return "the call after it computed a wrong product"
    return None


def apply_case(rank: int, n: int, name: str) -> dict:
    """``parallelize_module`` of case ``name``: what this rank raised (class and message, "applied" when
    nothing), the seconds it took, and whether a plain commfuse call works on the group afterwards."""
    import copy

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model, plan = case(name, rank, n)
    before = copy.deepcopy(model)
    start = time.perf_counter()
    try:
        parallelize_module(model, mesh, plan)
        kind, message = "applied", ""
    except Exception as e:  # noqa: BLE001 - handed to the test
        kind, message = type(e).__name__, str(e)
        notes = getattr(e, "__notes__", None)
        if notes:
            message += "\n" + "\n".join(notes)
    seconds = time.perf_counter() - start
    out = {"kind": kind, "message": message, "seconds": seconds, "after": _usable(mesh, rank, n)}
    if kind == "applied" and name == "happy":
        out["same output"] = _same_output(model, before, rank, n)
    return out


def _same_output(model: Model, before: Model, rank: int, n: int) -> str | None:
    """The parallelized blocks on this rank's sequence shard against the unsharded blocks on the whole."""
    x = torch.randn(2, 4 * n, DIM, generator=torch.Generator().manual_seed(3))
    layer, ref = model.layers[0], before.layers[0]
    for which in ("attention", "feed_forward"):
        got = getattr(layer, which)(x.tensor_split(n, dim=1)[rank])
        want = getattr(ref, which)(x).tensor_split(n, dim=1)[rank]
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            return f"{which}: max diff {(got - want).abs().max().item():.3g}"
    return None
