"""Rank-side bodies of the mixed-precision tests: commfuse's ops, layers and styles under torch.autocast against
torch's own styles and unsharded modules under the same autocast (dtypes equal, values within the dtype's
tolerance, forward and backward), mixed-dtype inputs without autocast, and FSDP2's MixedPrecisionPolicy.

Every comparison also returns a row of the autocast comparison table (test_mixed_precision_gloo prints it)."""

from __future__ import annotations

import sys
import traceback
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

import commfuse as cf
from commfuse import tp
from commfuse.models import llama

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the relative tolerance per autocast dtype: max |commfuse - reference| <= TOL * max |reference|, on outputs and
#: on every gradient (sums in another order, rounded to the dtype at every hop of a ring)
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = (torch.bfloat16, torch.float16)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _run(results, name, fn):
    try:
        results[name] = ("ok", fn())
    except Exception as e:
        results[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")


def _diff(got, want) -> tuple[float, float]:
    """(max |got - want|, max |want|) in float32."""
    got, want = _full(got).detach().float(), _full(want).detach().float()
    if got.shape != want.shape:
        raise AssertionError(f"shape {list(got.shape)} != {list(want.shape)}")
    return (got - want).abs().max().item(), want.abs().max().item()


class _Side:
    """One side of a comparison: its output and the dtypes and values of the gradients that matter."""

    def __init__(self, out, grads: dict):
        self.out, self.grads = out, grads

    def dtypes(self) -> str:
        return ",".join(sorted({_name(g.dtype) for g in self.grads.values()}))


def _compare(what: str, dtype, theirs: _Side, ours: _Side) -> dict:
    """Assert equal dtypes (output and every gradient) and values within ``TOL``; return the table row. Every
    difference is measured first (whole DTensors are gathered: every rank takes part in the same order), then
    checked."""
    if sorted(ours.grads) != sorted(theirs.grads):
        raise AssertionError(f"{what}: gradients of {sorted(ours.grads)}, torch's of {sorted(theirs.grads)}")
    worst_out, scale = _diff(ours.out, theirs.out)
    diffs = {name: _diff(ours.grads[name], want) for name, want in theirs.grads.items()}
    if ours.out.dtype != theirs.out.dtype:
        raise AssertionError(f"{what}: output dtype {ours.out.dtype}, torch's {theirs.out.dtype}")
    if worst_out > TOL[dtype] * max(scale, 1.0):
        raise AssertionError(f"{what}: outputs differ by {worst_out:.3g} (max |torch's| {scale:.3g})")
    for name, want in theirs.grads.items():
        got = ours.grads[name]
        if got.dtype != want.dtype:
            raise AssertionError(f"{what}: {name} gradient is {got.dtype}, torch's {want.dtype}")
        d, s = diffs[name]
        if d > TOL[dtype] * max(s, 1.0):
            raise AssertionError(f"{what}: {name} gradients differ by {d:.3g} (max |torch's| {s:.3g})")
    return {"what": what, "autocast": _name(dtype), "torch_out": _name(theirs.out.dtype),
            "commfuse_out": _name(ours.out.dtype), "torch_grads": theirs.dtypes(), "commfuse_grads": ours.dtypes(),
            "max_out_diff": worst_out, "max_grad_diff": max((d for d, _ in diffs.values()), default=0.0)}


def _side(module: nn.Module, x: torch.Tensor, dtype, g_seed: int, call=None, grads_of=None) -> _Side:
    """Forward under ``torch.autocast(cpu, dtype)`` and a backward of ``sum(out * G)`` outside it."""
    for p in module.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        out = (module if call is None else call)(x)
    local = out.to_local() if isinstance(out, DTensor) else out
    g = torch.randn(local.shape, generator=torch.Generator().manual_seed(g_seed))
    (local.float() * g).sum().backward()
    grads = {"input": x.grad}
    for name, p in (grads_of or module.named_parameters)():
        grads[name] = p.grad
    return _Side(out, grads)


# -- commfuse.tp's styles against torch's ---------------------------------------------------------------------------


class _FFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.feed_forward = llama.FeedForward(dim, hidden)

    def forward(self, x):
        return self.feed_forward(x)


class _Attn(nn.Module):
    def __init__(self, dim, heads, kv_heads, cache):
        super().__init__()
        self.attention, self.cache = llama.Attention(dim, heads, kv_heads), cache

    def forward(self, x):
        return self.attention(x, self.cache)


def _style_cases(n: int) -> dict:
    """name -> (make the model, torch's plan, commfuse's plan, the input's full shape, its dtype, how a rank takes
    its piece of the input)."""
    dim, seq = 8 * n, 4 * n
    cache = llama.rope_cache(4, seq)  # head_dim 4: 2n query heads, n key/value heads over 8n features
    seq_shard = ("seq", 1)
    return OrderedDict(
        colwise=(lambda: nn.Linear(dim, 4 * n),
                 TorchColwise(input_layouts=Shard(1)), tp.ColwiseParallel(input_layouts=Shard(1)),
                 (2, seq, dim), torch.float32, seq_shard),
        rowwise=(lambda: nn.Linear(4 * n, dim),
                 TorchRowwise(output_layouts=Shard(1)), tp.RowwiseParallel(output_layouts=Shard(1)),
                 (2, seq, 4 * n), torch.float32, ("features", 2)),
        # what attention under autocast hands on: an activation already in the autocast dtype
        **{"rowwise-lowp-in": (lambda: nn.Linear(4 * n, dim),
                               TorchRowwise(output_layouts=Shard(1)), tp.RowwiseParallel(output_layouts=Shard(1)),
                               (2, seq, 4 * n), "autocast", ("features", 2))},
        mlp=(lambda: nn.Sequential(OrderedDict(w1=nn.Linear(dim, 4 * n), act=nn.SiLU(), w2=nn.Linear(4 * n, dim))),
             {"w1": TorchColwise(input_layouts=Shard(1)), "w2": TorchRowwise(output_layouts=Shard(1))},
             {"w1": tp.ColwiseParallel(input_layouts=Shard(1)), "w2": tp.RowwiseParallel(output_layouts=Shard(1))},
             (2, seq, dim), torch.float32, seq_shard),
        swiglu=(lambda: _FFN(dim, 4 * n),
                {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                 "feed_forward.w1": TorchColwise(), "feed_forward.w3": TorchColwise(),
                 "feed_forward.w2": TorchRowwise(output_layouts=Shard(1))},
                {"feed_forward": tp.SwiGLUParallel()}, (2, seq, dim), torch.float32, seq_shard),
        attention=(lambda: _Attn(dim, 2 * n, n, cache),
                   {"attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                    desired_input_layouts=(Replicate(), None)),
                    "attention.wq": TorchColwise(), "attention.wk": TorchColwise(), "attention.wv": TorchColwise(),
                    "attention.wo": TorchRowwise(output_layouts=Shard(1))},
                   {"attention": tp.AttentionParallel(head_dim=4, rope=llama.apply_rope)},
                   (2, seq, dim), torch.float32, seq_shard),
    )


def _piece(x, how, rank, n):
    _, dim = how
    return x.tensor_split(n, dim=dim)[rank].clone()


def _parallelized(make, plan, mesh, seed):
    torch.manual_seed(seed)
    model = make()
    return parallelize_module(model, mesh, plan)


def styles(rank, n):
    """Each style under autocast (bfloat16, float16) against torch's plan for the same model: one row each."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    for name, (make, theirs_plan, ours_plan, shape, in_dtype, how) in _style_cases(n).items():
        for dtype in DTYPES:
            def body(make=make, theirs_plan=theirs_plan, ours_plan=ours_plan, shape=shape, in_dtype=in_dtype,
                     how=how, dtype=dtype, name=name):
                import copy

                theirs = _parallelized(make, copy.deepcopy(theirs_plan), mesh, 3)
                ours = _parallelized(make, copy.deepcopy(ours_plan), mesh, 3)
                x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
                x = _piece(x, how, rank, n).to(dtype if in_dtype == "autocast" else in_dtype)
                side_t = _side(theirs, x, dtype, 7)
                side_o = _side(ours, x, dtype, 7)
                return _compare(f"tp.{_STYLE_NAMES[name]}", dtype, side_t, side_o)

            _run(results, f"{name}-{_name(dtype)}", body)
    return results


_STYLE_NAMES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel",
                "rowwise-lowp-in": "RowwiseParallel (low-precision input)", "mlp": "Colwise+RowwiseParallel MLP",
                "swiglu": "SwiGLUParallel", "attention": "AttentionParallel"}


# -- commfuse.nn's layers against the unsharded modules (ShardedLinear: against FSDP2's nn.Linear) -------------------


class _RefAttention(nn.Module):
    def __init__(self, q, k, v, o, heads, causal=True):
        super().__init__()
        self.q, self.k, self.v, self.o, self.heads, self.causal = q, k, v, o, heads, causal

    def forward(self, x):
        b, s, _ = x.shape
        d = self.q.out_features // self.heads
        q, k, v = self.q(x).view(b, s, -1, d), self.k(x).view(b, s, -1, d), self.v(x).view(b, s, -1, d)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        o = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=self.causal)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


def _full_grads(module: nn.Module, rename=None):
    """The named parameters' whole gradients (DTensor shards gathered)."""
    def named():
        for name, p in module.named_parameters():
            yield (rename or {}).get(name, name), _Grad(p)
    return named


class _Grad:
    """A parameter whose ``grad`` reads back whole (DTensor gradients gathered)."""

    def __init__(self, p):
        self.p = p

    @property
    def grad(self):
        return _full(self.p.grad)


def layers(rank, n):
    """Each commfuse.nn layer under autocast against the unsharded torch module under the same autocast (the
    input is the sequence shard, the reference gets the whole sequence), ShardedLinear against FSDP2's
    fully_shard(nn.Linear): one row each."""
    from torch.distributed.fsdp import fully_shard

    from commfuse.nn import (
        ColumnParallelLinear,
        ParallelAttention,
        ParallelMLP,
        RowParallelLinear,
        ShardedLinear,
        UlyssesAttention,
    )

    results = {}
    h, ffn, seq = 8 * n, 4 * n, 4 * n

    def seq_parallel(make_pair, what, dtype, in_dim, out_dim):
        """The layer on this rank's piece of the input (split along ``in_dim``) against the unsharded reference
        on the whole; its output is this rank's piece along ``out_dim`` (None: the whole)."""
        torch.manual_seed(11)
        ref, layer, rename = make_pair()
        in_features = ref.in_features if isinstance(ref, nn.Linear) else h
        x = torch.randn(2, seq, in_features, generator=torch.Generator().manual_seed(12))
        side_t = _side(ref, x, dtype, 13, grads_of=_full_grads(ref))

        def mine(t, dim):
            return t if dim is None else t.tensor_split(n, dim=dim)[rank]

        for p in layer.parameters():
            p.grad = None
        xm = mine(x, in_dim).clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            out = layer(xm)
        g = torch.randn(side_t.out.shape, generator=torch.Generator().manual_seed(13))
        (out.float() * mine(g, out_dim)).sum().backward()
        theirs = _Side(mine(side_t.out, out_dim), {"input": mine(side_t.grads["input"], in_dim),
                                                   **{k: v for k, v in side_t.grads.items() if k != "input"}})
        ours_grads = {"input": xm.grad}
        for name, p in layer.named_parameters():
            ours_grads[rename.get(name, name)] = _full(p.grad)
        return _compare(what, dtype, theirs, _Side(out, ours_grads))

    def column():
        ref = nn.Linear(h, ffn)
        return ref, ColumnParallelLinear.from_linear(ref, algorithm="ring"), {}

    def row():
        ref = nn.Linear(ffn, h)
        return ref, RowParallelLinear.from_linear(ref, algorithm="ring"), {}

    def mlp():
        fc1, fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)
        ref = nn.Sequential(OrderedDict(fc1=fc1, act=nn.GELU(), fc2=fc2))
        return ref, ParallelMLP.from_linears(fc1, fc2, algorithm="ring"), {}

    def attention():
        heads, kv = 2 * n, n
        q, k, v, o = nn.Linear(h, h, bias=True), nn.Linear(h, h // 2), nn.Linear(h, h // 2), nn.Linear(h, h)
        ref = _RefAttention(q, k, v, o, heads)
        layer = ParallelAttention.from_linears(q, k, v, o, num_heads=heads, num_kv_heads=kv, algorithm="ring")
        rename = {"wq": "q.weight", "wk": "k.weight", "wv": "v.weight", "wo": "o.weight", "bq": "q.bias",
                  "bk": "k.bias", "bv": "v.bias", "bo": "o.bias"}
        return ref, layer, rename

    def ulysses():
        heads, kv = 2 * n, n
        q, k, v, o = nn.Linear(h, h), nn.Linear(h, h // 2), nn.Linear(h, h // 2), nn.Linear(h, h)
        ref = _RefAttention(q, k, v, o, heads)
        layer = UlyssesAttention.from_linears(q, k, v, o, num_heads=heads, num_kv_heads=kv, algorithm="ring")
        rename = {f"{p}_proj.{w}": f"{p}.{w}" for p in "qkvo" for w in ("weight", "bias")}
        return ref, layer, rename

    # (name, the pair, the input's split dim, the output's: sequence 1, features 2 / -1)
    cases = [("ColumnParallelLinear", column, 1, -1), ("RowParallelLinear", row, 2, 1), ("ParallelMLP", mlp, 1, 1),
             ("ParallelAttention", attention, 1, 1), ("UlyssesAttention", ulysses, 1, 1)]
    for what, make_pair, in_dim, out_dim in cases:
        for dtype in DTYPES:
            _run(results, f"{what}-{_name(dtype)}",
                 lambda make_pair=make_pair, what=what, dtype=dtype, in_dim=in_dim, out_dim=out_dim:
                 seq_parallel(make_pair, f"nn.{what}", dtype, in_dim, out_dim))

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))

    def sharded(dtype):
        torch.manual_seed(21)
        lin = nn.Linear(h, 4 * n)
        theirs = nn.Sequential(nn.Linear(h, 4 * n))
        theirs[0].load_state_dict(lin.state_dict())
        ours = nn.Sequential(ShardedLinear.from_linear(lin, algorithm="ring"))
        fully_shard(theirs, mesh=mesh)
        cf.fsdp.fully_shard(ours, mesh=mesh)
        x = torch.randn(2, 3, h, generator=torch.Generator().manual_seed(22 + rank))  # each rank its own batch
        return _compare("nn.ShardedLinear (against FSDP2)", dtype, _side(theirs, x, dtype, 23, grads_of=_full_grads(theirs)),
                        _side(ours, x, dtype, 23, grads_of=_full_grads(ours)))

    for dtype in DTYPES:
        _run(results, f"ShardedLinear-{_name(dtype)}", lambda dtype=dtype: sharded(dtype))
    return results


# -- the functional ops and torch.compile ---------------------------------------------------------------------------


def ops(rank, n):
    """The functional ops under autocast against all_gather / reduce_scatter then matmul under the same
    autocast: the outputs in the autocast dtype, the gradients in the inputs' dtypes, values within its
    tolerance; produce_reduce_scatter's partials made (and sent) in it."""
    results = {}
    g = torch.Generator().manual_seed(31)
    a_all = [torch.randn(2, 3, 8, generator=g) for _ in range(n)]
    w = torch.randn(8, 6, generator=g)
    dy = torch.randn(2, 3 * n, 6, generator=g)

    def agmm(dtype):
        a = a_all[rank].clone().requires_grad_()
        b = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            y = cf.all_gather_matmul(a, b, gather_dim=1, algorithm="ring")
        (y.float() * dy).sum().backward()
        ref_a = torch.cat(a_all, dim=1).requires_grad_()
        ref_b = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            ref = ref_a @ ref_b
        (ref.float() * dy).sum().backward()
        wg = b.grad.clone()
        dist.all_reduce(wg)  # every rank's share of the weight gradient, summed: the whole output's
        # every rank computes the whole output with the same dy: a's gradient (reduce-scattered) and the summed
        # weight gradient are n times the reference's
        return _compare("cf.all_gather_matmul", dtype, _Side(ref, {"a": ref_a.grad.tensor_split(n, 1)[rank] * n,
                                                                   "b": ref_b.grad * n}),
                        _Side(y, {"a": a.grad, "b": wg}))

    def mmrs(dtype):
        a = a_all[rank].repeat(1, n, 1).clone().requires_grad_()
        b = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            z = cf.matmul_reduce_scatter(a, b, scatter_dim=1, algorithm="ring")
        dz = dy[:, :, :].tensor_split(n, 1)[rank]
        (z.float() * dz).sum().backward()
        refs = [x.repeat(1, n, 1).clone().requires_grad_() for x in a_all]
        ref_b = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            parts = [x @ ref_b for x in refs]
        total = sum(p.float() for p in parts).to(dtype)
        (total.float() * dy).sum().backward()
        wg = b.grad.clone()
        dist.all_reduce(wg)
        return _compare("cf.matmul_reduce_scatter", dtype,
                        _Side(total.tensor_split(n, 1)[rank], {"a": refs[rank].grad, "b": ref_b.grad}),
                        _Side(z, {"a": a.grad, "b": wg}))

    def prs(dtype):
        x = a_all[rank].repeat(1, n, 1).clone().requires_grad_()
        b = w.clone().requires_grad_()

        def producer(d, x, b):
            return x.tensor_split(n, 1)[d] @ b  # under autocast: a partial in its dtype

        with torch.autocast("cpu", dtype=dtype):
            z = cf.produce_reduce_scatter(producer, inputs=(x, b), dim=1, algorithm="ring")
        dz = dy.tensor_split(n, 1)[rank]
        (z.float() * dz).sum().backward()
        refs = [t.repeat(1, n, 1).clone().requires_grad_() for t in a_all]
        ref_b = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            parts = [t @ ref_b for t in refs]
        total = sum(p.float() for p in parts).to(dtype)
        (total.float() * dy).sum().backward()
        wg = b.grad.clone()
        dist.all_reduce(wg)
        return _compare("cf.produce_reduce_scatter", dtype,
                        _Side(total.tensor_split(n, 1)[rank], {"x": refs[rank].grad, "b": ref_b.grad}),
                        _Side(z, {"x": x.grad, "b": wg}))

    for name, fn in (("all_gather_matmul", agmm), ("matmul_reduce_scatter", mmrs), ("produce_reduce_scatter", prs)):
        for dtype in DTYPES:
            _run(results, f"{name}-{_name(dtype)}", lambda fn=fn, dtype=dtype: fn(dtype))
    return results


def compiled(rank, n, backend):
    """The custom ops under torch.compile(fullgraph=True) and autocast (entered outside the compiled function
    and inside it): what eager gives under the same autocast, dtypes included; and the compiled layers."""
    import os
    import tempfile

    from commfuse.nn import ParallelAttention, ParallelMLP, ShardedLinear

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="commfuse-inductor-")
    results = {}
    g = torch.Generator().manual_seed(41)
    a, w1, w2 = torch.randn(2, 3, 8, generator=g), torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    x, w3 = torch.randn(2, 2 * n, 8, generator=g), torch.randn(8, 5, generator=g)

    def f(a, w1, w2, x, w3):
        y1, y2 = cf.all_gather_matmul(a, [w1, w2], gather_dim=1, algorithm="ring")
        z = cf.matmul_reduce_scatter(x, w3, scatter_dim=1, algorithm="ring")
        return y1, y2, z

    def inside(dtype):
        def g(*args):
            with torch.autocast("cpu", dtype=dtype):
                return f(*args)
        return g

    def step(fn, dtype, outside):
        leaves = [t.clone().requires_grad_() for t in (a, w1, w2, x, w3)]
        if outside:
            with torch.autocast("cpu", dtype=dtype):
                out = fn(*leaves)
        else:
            out = fn(*leaves)
        sum(o.float().pow(2).sum() for o in out).backward()
        return out, [t.grad for t in leaves]

    def fresh_cache():
        # torch 2.9's AOTAutograd cache does not key on the autocast dtype (later torch does): a graph compiled
        # under bfloat16 would be taken for float16
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="commfuse-inductor-")

    def functional(dtype, outside):
        torch._dynamo.reset()
        fresh_cache()
        want, want_g = step(f, dtype, True)
        got, got_g = step(torch.compile(f if outside else inside(dtype), fullgraph=True, backend=backend), dtype,
                          outside)
        for i, (o, e) in enumerate(zip(got, want)):
            if o.dtype != dtype or e.dtype != dtype:
                raise AssertionError(f"output {i}: compiled {o.dtype}, eager {e.dtype}; autocast asks {dtype}")
            d, s = _diff(o, e)
            if d > TOL[dtype] * max(s, 1.0):
                raise AssertionError(f"output {i}: compiled and eager differ by {d:.3g}")
        for i, (o, e) in enumerate(zip(got_g, want_g)):
            if o.dtype != torch.float32:
                raise AssertionError(f"gradient {i} is {o.dtype}, not the input's float32")
            d, s = _diff(o, e)
            if d > TOL[dtype] * max(s, 1.0):
                raise AssertionError(f"gradient {i}: compiled and eager differ by {d:.3g}")

    for dtype in DTYPES:
        for outside in (True, False):
            _run(results, f"functional-{_name(dtype)}-{'outside' if outside else 'inside'}",
                 lambda dtype=dtype, outside=outside: functional(dtype, outside))

    def layer(make, shape, dtype):
        torch.manual_seed(42)
        model = make()
        xx = torch.randn(*shape, generator=torch.Generator().manual_seed(43))
        torch._dynamo.reset()
        fresh_cache()
        eager = _side(model, xx, dtype, 44)
        got = _side(model, xx, dtype, 44, call=torch.compile(model, fullgraph=True, backend=backend))
        row = _compare(f"compiled {type(model).__name__}", dtype, eager, got)
        # and what torch's modules give under autocast: the output in its dtype, the gradients in float32
        if got.out.dtype != dtype or any(g.dtype != torch.float32 for g in got.grads.values()):
            raise AssertionError(f"compiled under autocast {dtype}: output {got.out.dtype}, gradients "
                                 f"{got.dtypes()}")
        return row

    for name, make, shape in (("mlp", lambda: ParallelMLP(16, 8 * n, algorithm="ring"), (2, 4, 16)),
                              ("attention", lambda: ParallelAttention(8 * n, 2 * n, num_kv_heads=n, bias=True,
                                                                      algorithm="ring"), (2, 4, 8 * n)),
                              ("sharded", lambda: ShardedLinear(16, 4 * n, algorithm="ring"), (2, 4, 16))):
        _run(results, f"layer-{name}", lambda make=make, shape=shape: layer(make, shape, torch.bfloat16))
    return results


# -- mixed dtypes without autocast ----------------------------------------------------------------------------------


def mixed(rank, n):
    """A bfloat16 activation into float32 weights, no autocast: torch's styles and nn.Linear refuse it (their
    matmul does), so commfuse refuses it too, by name (the style or layer, both dtypes, and autocast as the way
    out), and the group stays usable for the next call."""
    from torch.distributed.fsdp import fully_shard

    from commfuse.nn import ColumnParallelLinear, ParallelAttention, RowParallelLinear, ShardedLinear

    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    bf16 = torch.bfloat16

    def refused(call, words):
        try:
            call()
        except cf.errors.CommfuseError as e:
            text = str(e)
            missing = [w for w in words if w not in text]
            if missing:
                raise AssertionError(f"the error does not say {missing}: {text}") from e
            return text
        raise AssertionError("a bfloat16 input into float32 weights was taken without autocast")

    def torch_refuses(call):
        try:
            call()
        except RuntimeError as e:
            if "dtype" not in str(e):
                raise
            return
        raise AssertionError("torch took it: commfuse should match torch")

    def styles():
        torch.manual_seed(0)
        for make_t, make_o, shape, who in (
                (lambda: TorchColwise(input_layouts=Shard(1)), lambda: tp.ColwiseParallel(input_layouts=Shard(1)),
                 (2, 2, 8), "ColwiseParallel"),
                (lambda: TorchRowwise(output_layouts=Shard(1)), lambda: tp.RowwiseParallel(output_layouts=Shard(1)),
                 (2, 2 * n, 4), "RowwiseParallel")):
            in_f = shape[-1] * (n if who == "RowwiseParallel" else 1)
            theirs = parallelize_module(nn.Linear(in_f, 4 * n), mesh, make_t())
            ours = parallelize_module(nn.Linear(in_f, 4 * n), mesh, make_o())
            x = torch.randn(*shape, dtype=bf16)
            torch_refuses(lambda: theirs(x))
            refused(lambda: ours(x), [who, "bfloat16", "float32", "autocast"])
            y = ours(x.float())  # the next call on the group runs
            if y.dtype != torch.float32:
                raise AssertionError(f"{who} after the refusal: {y.dtype}")

    def layers():
        torch.manual_seed(0)
        col = ColumnParallelLinear(8, 4 * n)
        refused(lambda: col(torch.randn(2, 2, 8, dtype=bf16)), ["ColumnParallelLinear", "bfloat16", "float32",
                                                                  "autocast"])
        row = RowParallelLinear(4 * n, 8)
        refused(lambda: row(torch.randn(2, 2 * n, 4, dtype=bf16)), ["RowParallelLinear", "bfloat16", "autocast"])
        attn = ParallelAttention(8 * n, 2 * n)
        refused(lambda: attn(torch.randn(2, 2, 8 * n, dtype=bf16)), ["ParallelAttention", "bfloat16", "autocast"])
        torch_refuses(lambda: nn.Linear(8, 4)(torch.randn(2, 8, dtype=bf16)))
        # ShardedLinear: FSDP2's nn.Linear refuses too; commfuse's used to compute in the input's dtype silently
        dp = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
        theirs = nn.Sequential(nn.Linear(8, 4 * n))
        fully_shard(theirs, mesh=dp)
        torch_refuses(lambda: theirs(torch.randn(2, 8, dtype=bf16)))
        sharded = ShardedLinear(8, 4 * n, algorithm="ring")
        refused(lambda: sharded(torch.randn(2, 8, dtype=bf16)), ["ShardedLinear", "bfloat16", "float32", "autocast"])
        if sharded(torch.randn(2, 8)).dtype != torch.float32:
            raise AssertionError("ShardedLinear after the refusal")
        # the functional ops name their arguments and the way out
        refused(lambda: cf.all_gather_matmul(torch.randn(2, 8, dtype=bf16), torch.randn(8, 3)),
                ["all_gather_matmul", "bfloat16", "float32", "autocast"])

    _run(results, "styles", styles)
    _run(results, "layers", layers)
    return results


# -- FSDP2's MixedPrecisionPolicy -----------------------------------------------------------------------------------


def fsdp_policy(rank, n):
    """commfuse's styles on mesh['tp'] under torch's fully_shard on mesh['dp'] with MixedPrecisionPolicy
    (bfloat16 parameters, float32 reduction), against torch's styles under the same (2 x 2 mesh); and
    ShardedLinear beside a style-parallel MLP under commfuse.fsdp.fully_shard with the same policy, against the
    unsharded model under autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    results = {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    dp, tpm = mesh["dp"], mesh["tp"]
    t = tpm.size()

    def styles():
        rows = []
        for name, make, theirs_plan, ours_plan in (
                ("Colwise+RowwiseParallel MLP",
                 lambda: nn.Sequential(OrderedDict(w1=nn.Linear(16, 8 * t), act=nn.SiLU(), w2=nn.Linear(8 * t, 16))),
                 lambda: {"w1": TorchColwise(input_layouts=Shard(1)), "w2": TorchRowwise(output_layouts=Shard(1))},
                 lambda: {"w1": tp.ColwiseParallel(input_layouts=Shard(1)),
                          "w2": tp.RowwiseParallel(output_layouts=Shard(1))}),
                ("SwiGLUParallel", lambda: _FFN(16, 8 * t),
                 lambda: {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                             desired_input_layouts=(Replicate(),)),
                          "feed_forward.w1": TorchColwise(), "feed_forward.w3": TorchColwise(),
                          "feed_forward.w2": TorchRowwise(output_layouts=Shard(1))},
                 lambda: {"feed_forward": tp.SwiGLUParallel()})):
            models = []
            for plan in (theirs_plan(), ours_plan()):
                torch.manual_seed(9)
                model = parallelize_module(make(), tpm, plan)
                fully_shard(model, mesh=dp, mp_policy=policy)
                models.append(model)
            x = torch.randn(2, 2, 4 * t, 16, generator=torch.Generator().manual_seed(10))[dp.get_local_rank()]
            x = x.tensor_split(t, dim=1)[tpm.get_local_rank()]
            sides = []
            for model in models:
                xx = x.clone().requires_grad_()
                y = model(xx)
                g = torch.randn(y.shape, generator=torch.Generator().manual_seed(11))
                (y.float() * g).sum().backward()
                sides.append(_Side(y, {"input": xx.grad, **{k: p.grad for k, p in model.named_parameters()}}))
            theirs, ours = sides
            for k, gr in ours.grads.items():
                if k != "input" and gr.dtype != torch.float32:
                    raise AssertionError(f"{name}: {k}'s gradient is {gr.dtype}, not the parameters' float32")
            rows.append(_compare(f"tp.{name} under FSDP2 MixedPrecisionPolicy", torch.bfloat16, theirs, ours))
        return rows

    def sharded_beside_styles():
        from commfuse.nn import ShardedLinear

        torch.manual_seed(12)
        lin = nn.Linear(16, 4 * n)
        ref = nn.Sequential(nn.Linear(16, 4 * n), nn.ReLU(), nn.Linear(4 * n, 8))
        ref[0].load_state_dict(lin.state_dict())
        mine = nn.Sequential(ShardedLinear.from_linear(lin, algorithm="ring"), nn.ReLU(), nn.Linear(4 * n, 8))
        mine[2].load_state_dict(ref[2].state_dict())
        flat = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
        cf.fsdp.fully_shard(mine, mesh=flat, mp_policy=policy)
        x = torch.randn(n, 3, 16, generator=torch.Generator().manual_seed(13))
        y = mine(x[rank : rank + 1])
        if y.dtype != torch.bfloat16:
            raise AssertionError(f"output {y.dtype}, not the policy's bfloat16")
        y.float().square().sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the same computation in bfloat16, unsharded
            want = ref(x)
        (want.float().square().sum() / n).backward()  # FSDP2 averages the ranks' gradients
        d, s = _diff(y, want[rank : rank + 1])
        if d > TOL[torch.bfloat16] * max(s, 1.0):
            raise AssertionError(f"output differs by {d:.3g}")
        for (name, pm), (_, pr) in zip(mine.named_parameters(), ref.named_parameters()):
            if pm.grad.dtype != torch.float32:
                raise AssertionError(f"{name}'s gradient is {pm.grad.dtype}, not float32")
            d, s = _diff(pm.grad, pr.grad)
            if d > 2 * TOL[torch.bfloat16] * max(s, 1.0):
                raise AssertionError(f"{name}'s gradient differs by {d:.3g} (max {s:.3g})")

    _run(results, "styles", styles)
    _run(results, "sharded-beside-fsdp", sharded_beside_styles)
    return results
