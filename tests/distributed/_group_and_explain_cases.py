"""Rank-side bodies of the group= and visible-decision tests (run inside ``commfuse.launch`` processes).

Each body returns plain data that the pytest side asserts on; every transfer is real gloo."""

from __future__ import annotations

import io
import logging
import sys
import time
from collections import OrderedDict

import torch
from torch import nn

import commfuse as cf
from commfuse.errors import CommfuseError

TIMEOUT = 30.0


def _ints(shape, seed):
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).float()


def _outcome(fn):
    """("ok", value) or (error type, message, whether a commfuse error, seconds)."""
    t0 = time.monotonic()
    try:
        return ("ok", fn(), True, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - reported by name
        return (type(e).__name__, str(e), isinstance(e, CommfuseError), time.monotonic() - t0)


def _meshes(n):
    from torch.distributed.device_mesh import init_device_mesh

    flat = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    two = init_device_mesh("cpu", (1, n), mesh_dim_names=("dp", "tp"))
    return flat, two


def _op_calls(rank, n):
    """Every functional op, as ``f(group) -> a flat tensor``: the same data on every call."""
    a, b = _ints((4, 8), rank), _ints((8, 5), 99)
    m = _ints((4 * n, 8), 7 + rank)
    parts = {d: _ints((3, 5), 10 * rank + d) for d in range(n)}
    chunks = [_ints((2, 3), 100 * rank + d) for d in range(n)]

    def flat(x):
        return torch.cat([t.flatten() for t in x]) if isinstance(x, (list, tuple)) else x.flatten()

    return {
        "all_gather_matmul": lambda g: flat(cf.all_gather_matmul(a, b, group=g, algorithm="ring", timeout=TIMEOUT)),
        "matmul_reduce_scatter": lambda g: flat(cf.matmul_reduce_scatter(m, b, group=g, algorithm="ring",
                                                                         timeout=TIMEOUT)),
        "all_gather_consume": lambda g: flat(cf.all_gather_consume(a, lambda t, s: t * (s + 1), group=g,
                                                                   algorithm="ring", timeout=TIMEOUT)),
        "produce_reduce_scatter": lambda g: flat(cf.produce_reduce_scatter(lambda d: parts[d].clone(), group=g,
                                                                           algorithm="ring", timeout=TIMEOUT)),
        "all_to_all_consume": lambda g: flat(cf.all_to_all_consume(chunks, lambda t, s: t + s, group=g,
                                                                   algorithm="ring", timeout=TIMEOUT)),
        "produce_all_to_all": lambda g: flat(cf.produce_all_to_all(lambda d: chunks[d].clone(), group=g,
                                                                   algorithm="ring", timeout=TIMEOUT)),
    }


def group_forms(rank, n):
    """Each op with group= a ProcessGroup, a 1-D DeviceMesh and a 2-D one: (name, form) -> outcome, the 1-D
    mesh's result compared with the group's; then one plain call, to show the group still in step."""
    flat, two = _meshes(n)
    out = {}
    for name, call in _op_calls(rank, n).items():
        by_group = call(flat.get_group())
        got = _outcome(lambda: call(flat))
        out[(name, "mesh")] = got[:1] + (bool(got[0] == "ok" and torch.equal(got[1], by_group)),)
        out[(name, "2-D mesh")] = _outcome(lambda: call(two))[:3]
        again = _outcome(lambda: call(flat.get_group()))
        out[(name, "after")] = (again[0], bool(again[0] == "ok" and torch.equal(again[1], by_group)))
    return out


def layers_and_styles_refuse_a_2d_mesh(rank, n):
    """Every layer and style given a 2-D mesh: the error, by name. And each given the 1-D mesh: builds."""
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse.nn import (
        ColumnParallelLinear,
        MoE,
        ParallelAttention,
        ParallelMLP,
        RowParallelLinear,
        ShardedLinear,
        UlyssesAttention,
    )
    from commfuse.tp import ColwiseParallel, RowwiseParallel

    flat, two = _meshes(n)
    makers = {
        "ColumnParallelLinear": lambda g: ColumnParallelLinear(8, 8, group=g),
        "RowParallelLinear": lambda g: RowParallelLinear(8, 8, group=g),
        "ParallelMLP": lambda g: ParallelMLP(8, 16, group=g),
        "ParallelAttention": lambda g: ParallelAttention(8, 2, group=g),
        "UlyssesAttention": lambda g: UlyssesAttention(8, 2, group=g),
        "ShardedLinear": lambda g: ShardedLinear(8, 8, group=g),
        "MoE": lambda g: MoE(8, 8, 2 * n, 1, group=g),
        "ColwiseParallel": lambda g: parallelize_module(nn.Linear(8, 8), g, ColwiseParallel()),
        "RowwiseParallel": lambda g: parallelize_module(nn.Linear(8, 8), g, RowwiseParallel()),
    }
    out = {}
    for name, make in makers.items():
        out[(name, "2-D mesh")] = _outcome(lambda: make(two))[:3]
        out[(name, "mesh")] = _outcome(lambda: type(make(flat)).__name__)[:2]
    return out


def one_rank_bad_input_with_a_mesh(rank, n):
    """Rank 1 calls all_gather_matmul with group= a 1-D mesh and a b of the wrong dtype; its peers call it
    right. Every rank's outcome (the peers must be told, by name, not wait out the timeout), then two plain
    calls over the mesh, which must be right or a named error."""
    flat, _ = _meshes(n)
    a, b = _ints((4, 8), rank), _ints((8, 5), 99)
    full = torch.cat([_ints((4, 8), r) for r in range(n)]) @ b
    cf.all_gather_matmul(a, b, group=flat, algorithm="ring", timeout=TIMEOUT)  # the signature, checked once
    bad = b.double() if rank == 1 else b
    failing = _outcome(lambda: cf.all_gather_matmul(a, bad, group=flat, algorithm="ring", timeout=TIMEOUT))
    after = []
    for _ in range(2):
        got = _outcome(lambda: cf.all_gather_matmul(a, b, group=flat, algorithm="ring", timeout=TIMEOUT))
        after.append((got[0], got[0] == "ok" and bool(torch.equal(got[1], full)), got[2]))
    return failing[0], failing[1], failing[2], failing[3], after


def _model(n, mesh):
    """A model with a site of every kind: two styles fused, one style that falls back to DTensor, a ParallelMLP
    (two sites), a ParallelAttention given ``ring:2``, a UlyssesAttention, a ShardedLinear given ``vanilla``
    and an MoE; and a plain nn.Linear, which is no site."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse.nn import MoE, ParallelAttention, ParallelMLP, ShardedLinear, UlyssesAttention
    from commfuse.tp import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    tp = mesh
    block = nn.Sequential(OrderedDict(w1=nn.Linear(16, 32), act=nn.GELU(), w2=nn.Linear(32, 16)))
    parallelize_module(block, tp, {"w1": ColwiseParallel(input_layouts=Shard(1)),
                                   "w2": RowwiseParallel(output_layouts=Shard(1))})
    odd = parallelize_module(nn.Linear(16 * n, 16), tp, ColwiseParallel(input_layouts=Shard(2)))
    return nn.ModuleDict(OrderedDict(
        block=block, odd=odd, mlp=ParallelMLP(16, 32, group=tp),
        attention=ParallelAttention(16, 2, group=tp, algorithm="ring:2"),
        ulysses=UlyssesAttention(16, 2, group=tp), sharded=ShardedLinear(16, 16, group=tp, algorithm="vanilla"),
        moe=MoE(16, 8, 2 * n, 1, group=tp), plain=nn.Linear(16, 16)))


def _forward(model, rank, n):
    x = _ints((2, 4, 16), rank)  # this rank's sequence shard (batch 2, 4 positions)
    model["block"](x)
    model["odd"](_ints((2, 4, 16), 50 + rank))  # its features are this rank's shard: no fused op for them
    model["mlp"](x)
    model["attention"](x)
    model["ulysses"](x)
    model["sharded"](x)
    model["moe"](x)


def explain_and_log(rank, n):
    """commfuse.explain before and after two forwards, and what COMMFUSE_LOG=info printed meanwhile."""
    from commfuse import log as cflog
    from torch.distributed.device_mesh import init_device_mesh

    tp = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    captured = io.StringIO()
    saved, sys.stderr = sys.stderr, captured  # the handler COMMFUSE_LOG adds writes to stderr as it is then
    try:
        cflog.configure("info")
    finally:
        sys.stderr = saved
    model = _model(n, tp)
    before = cf.explain(model)
    _forward(model, rank, n)
    _forward(model, rank, n)
    after = cf.explain(model)
    lines = captured.getvalue().splitlines()
    for handler in list(logging.getLogger("commfuse").handlers):
        if getattr(handler, "_commfuse", False):
            logging.getLogger("commfuse").removeHandler(handler)
    rows = lambda e: [(s.path, s.kind, s.group, s.world_size, s.algorithm, s.taken, s.fallbacks) for s in e]  # noqa: E731
    return {"before": rows(before), "after": rows(after), "text": str(after), "lines": lines}


# -- every site named by its path: identical layers, reused styles, with and without explain ---------------------

LAYERS = 3


class _Stack(nn.Module):
    """``LAYERS`` Llama blocks (``commfuse.models.llama``), then two ``ParallelMLP`` (two sites each): identical
    layers, called from the model's own forward."""

    def __init__(self, tp):
        from commfuse.models.llama import Block
        from commfuse.nn import ParallelMLP

        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.mlps = nn.ModuleList(ParallelMLP(32, 64, group=tp) for _ in range(2))

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache)
        for mlp in self.mlps:
            x = mlp(x)
        return x


def _stack(tp, styles: str, rope=None):
    """The stack, its blocks parallelized with commfuse's block styles: ``shared``, one plan (so one style object
    per sub-block) applied to every block; ``fresh``, a new plan per block; ``wildcard``, one plan over the whole
    model whose keys match every block (``layers.*.attention``), as torch's plans are written. ``rope``: the
    attention's rope hook per block (index -> hook), default ``apply_rope``."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from commfuse.models.llama import apply_rope, commfuse_plan
    from commfuse.tp import AttentionParallel, SwiGLUParallel

    model = _Stack(tp)
    if styles == "wildcard":
        parallelize_module(model, tp, {
            "layers.*.attention_norm": SequenceParallel(), "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.attention": AttentionParallel(head_dim=8, rope=apply_rope),
            "layers.*.feed_forward": SwiGLUParallel()})
        return model
    shared = commfuse_plan()
    for i, block in enumerate(model.layers):
        plan = shared if styles == "shared" else commfuse_plan()
        if rope is not None and i in rope:
            plan = dict(plan, attention=AttentionParallel(head_dim=8, rope=rope[i]))
        parallelize_module(block, tp, plan)
    return model


def _steps(model, rank, steps, seq=8):
    from commfuse.models.llama import rope_cache

    cache = rope_cache(8, seq * 2)
    for step in range(steps):
        x = torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x, cache).square().mean().backward()


def _plain():
    """Whether the sites and the fused ops' fast path run their plain code (no site is due to watch), and the
    sites still due."""
    from commfuse import ops
    from commfuse.planning import table
    from commfuse.runtime import sites

    door = sites.at_site
    plain = (door.__enter__ is getattr(door, "_enter", None) and door.__exit__ is getattr(door, "_exit", None)
             and ops._planned is table.get)
    return plain, sorted(site.label for site in getattr(sites, "_due", {}).values())


def every_site_named(rank, n):
    """For each way of applying the styles, with and without ``commfuse.explain`` before training: two training
    steps with ``COMMFUSE_LOG=info``, then what explain lists and the log lines. Then, once the earlier models
    are collected, one more step of the last model: whether the sites and the fast path are back on their plain
    code after it (``plain``; ``warm``, before it, for the test's message)."""
    from commfuse import log as cflog
    from torch.distributed.device_mesh import init_device_mesh

    tp = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    captured = io.StringIO()
    saved, sys.stderr = sys.stderr, captured  # the handler COMMFUSE_LOG adds writes to stderr as it is then
    try:
        cflog.configure("info")
    finally:
        sys.stderr = saved
    out = {}
    try:
        for styles in ("shared", "fresh", "wildcard"):
            for explain_first in (False, True):
                cf.backends.release()  # each case plans afresh: its first layer plans, the others find the plans
                model = _stack(tp, styles)
                if explain_first:
                    cf.explain(model)
                captured.seek(0)
                captured.truncate()
                _steps(model, rank, 2)
                rows = [(s.path, s.kind, s.algorithm, s.taken, s.fallbacks) for s in cf.explain(model)]
                out[(styles, explain_first)] = {"rows": rows, "lines": captured.getvalue().splitlines()}
        import gc

        gc.collect()  # the models of the earlier cases hold their sites in reference cycles
        out["warm"] = _plain()
        _steps(model, rank, 1)
        out["plain"] = _plain()
    finally:
        for handler in list(logging.getLogger("commfuse").handlers):
            if getattr(handler, "_commfuse", False):
                logging.getLogger("commfuse").removeHandler(handler)
    return out


def error_in_layer_one(rank, n):
    """Errors raised at a site of the middle block, on a model nobody called ``explain`` on:

    - ``dtype``: every rank's block 1 gets a float64 input (a forward pre-hook), which its fused gather refuses;
    - ``peer``: rank 1's rope hook of block 1 raises on the second step; the peers wait in block 1's
      reduce-scatter and are told.

    Each outcome (type, message, notes), then the flight recorder's dump of every rank (``COMMFUSE_TRACE_DIR``,
    set by the test)."""
    from commfuse import metrics
    from commfuse.models.llama import apply_rope
    from torch.distributed.device_mesh import init_device_mesh

    tp = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out = {}

    def outcome(fn):
        try:
            fn()
            return ("ok", "", [])
        except Exception as e:  # noqa: BLE001 - reported by name
            return (type(e).__name__, str(e), list(getattr(e, "__notes__", [])))

    model = _stack(tp, "fresh")
    _steps(model, rank, 1)
    hook = model.layers[1].register_forward_pre_hook(lambda m, args: (args[0].double(), *args[1:]))
    out["dtype"] = outcome(lambda: _steps(model, rank, 1))
    hook.remove()
    out["dtype after"] = outcome(lambda: _steps(model, rank, 1))

    calls = [0]

    def rope(q, k, cache):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise ValueError("rope hook of block 1 failed on purpose")
        return apply_rope(q, k, cache)

    model = _stack(tp, "fresh", rope={1: rope})
    _steps(model, rank, 1)
    out["peer"] = outcome(lambda: _steps(model, rank, 1))
    out["dumps"] = metrics.dump_trace()
    return out
