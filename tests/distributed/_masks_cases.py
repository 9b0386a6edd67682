"""Rank-side bodies of the attention-mask tests: commfuse.nn.ParallelAttention and commfuse.tp.AttentionParallel
with causal + additive, boolean and document masks (document ids, cumulative lengths, torchtitan's
VarlenMetadata, FlexAttention's BlockMask) against the unsharded attention computed by plain
scaled_dot_product_attention with the same mask, forward and backward, eager and compiled; and the arguments
that are refused by name."""

from __future__ import annotations

import os
import sys
import tempfile
from collections import namedtuple
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import commfuse as cf
from commfuse import tp
from commfuse.models import llama

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_cases import _full, _run, expect  # noqa: E402  (the shared rank-side runner of the DTensor tests)

TOL = dict(rtol=1e-4, atol=1e-5)  # float32, summed in another order
#: torchtitan's VarlenMetadata (cu_seq_q, cu_seq_k, max_q, max_k), as its models pass it
VarlenMetadata = namedtuple("VarlenMetadata", "cu_seq_q cu_seq_k max_q max_k")


def _close(got, want, what):
    got, want = _full(got).detach(), _full(want).detach()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if not torch.allclose(got, want, **TOL):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g}")


# -- the masks, and what each means to plain SDPA over the whole sequence -------------------------------------------


def _lengths(n):
    """Per batch row, document lengths over a sequence of 4n positions whose boundaries fall inside query slices
    (slices of 4 rows) and across them."""
    s = 4 * n
    return [[3, 6, s - 9], [s - 2, 2]] if s > 9 else [[3, s - 3], [s - 2, 2]]


def _document_ids(n):
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in _lengths(n)])


def _cu_seqlens(n):
    s, ends = 4 * n, [0]
    for r, row in enumerate(_lengths(n)):
        for length in row:
            ends.append(ends[-1] + length)
    assert ends[-1] == 2 * s
    return torch.tensor(ends, dtype=torch.int32)


def _block_mask(n, causal):
    from torch.nn.attention.flex_attention import create_block_mask

    ids = _document_ids(n)

    def document(b, h, q, kv):  # torchtitan's document mask_mod
        same = ids[b, q] == ids[b, kv]
        return same & (q >= kv) if causal else same

    return create_block_mask(document, 2, None, 4 * n, 4 * n, device="cpu")


def _masks(n, heads):
    """name -> (how the layer is given it: the keyword and the value, the dense mask SDPA takes for it: bool or
    additive, broadcastable to (2, heads, s, s), without the causal part)."""
    s = 4 * n
    g = torch.Generator().manual_seed(5)
    additive = torch.randn(s, s, generator=g)
    per_head = torch.randn(1, heads, s, s, generator=g)
    boolean = torch.rand(2, 1, s, s, generator=g) > 0.3
    boolean |= torch.eye(s, dtype=torch.bool)  # every query sees at least itself
    ids = _document_ids(n)
    docs = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    varlen = VarlenMetadata(_cu_seqlens(n), _cu_seqlens(n), s, s)
    return {
        "additive": (("attn_mask", additive), additive),
        "additive-per-head": (("attn_mask", per_head), per_head),
        "boolean": (("attn_mask", boolean), boolean),
        "document-ids": (("document_ids", ids), docs),
        "cu-seqlens": (("cu_seqlens", _cu_seqlens(n)), docs),
        "varlen-metadata": (("attn_mask", varlen), docs),
        "block-mask": (("attn_mask", "block"), docs),
    }


def _sdpa(q, k, v, causal, mask):
    """Plain SDPA over the whole sequence: q (b, s, H, d), k and v (b, s, Hkv, d), ``mask`` as above."""
    s = q.shape[1]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    m = mask
    if causal:
        lower = torch.ones(s, s, dtype=torch.bool).tril()
        if m is None:
            m = lower
        elif m.dtype == torch.bool:
            m = m & lower
        else:
            m = m.masked_fill(~lower, float("-inf"))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m)
    return o.transpose(1, 2)


class _Reference(nn.Module):
    """The unsharded attention: projections, optional RoPE, SDPA with the mask, out-projection."""

    def __init__(self, q, k, v, o, heads, cache=None):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo, self.heads, self.cache = q, k, v, o, heads, cache

    def forward(self, x, causal, mask):
        b, s, _ = x.shape
        d = self.wq.out_features // self.heads
        q, k, v = self.wq(x).view(b, s, -1, d), self.wk(x).view(b, s, -1, d), self.wv(x).view(b, s, -1, d)
        if self.cache is not None:
            q, k = llama.apply_rope(q, k, self.cache)
        return self.wo(_sdpa(q, k, v, causal, mask).reshape(b, s, -1))


def _projections(n, bias):
    torch.manual_seed(3)
    h = 8 * n  # 2n query heads and n key/value heads of 4
    return (nn.Linear(h, h, bias=bias), nn.Linear(h, h // 2, bias=bias), nn.Linear(h, h // 2, bias=bias),
            nn.Linear(h, h, bias=bias))


def _given(name, spec, n, causal):
    key, value = spec
    if value == "block":
        value = _block_mask(n, causal)
    return key, value


# -- commfuse.nn.ParallelAttention ----------------------------------------------------------------------------------


def parallel_attention(rank, n):
    """ParallelAttention(x, <mask>) on this rank's sequence shard against the unsharded SDPA with the mask:
    the output rows, the input gradient, every weight gradient; causal and not, ring and vanilla."""
    from commfuse.nn import ParallelAttention

    results = {}
    s, h = 4 * n, 8 * n
    for name, (spec, dense) in _masks(n, 2 * n).items():
        for causal in (True, False):
            for algorithm in ("ring", "vanilla"):
                def body(spec=spec, dense=dense, causal=causal, algorithm=algorithm, name=name):
                    q, k, v, o = _projections(n, bias=True)
                    ref = _Reference(q, k, v, o, 2 * n)
                    layer = ParallelAttention.from_linears(q, k, v, o, num_heads=2 * n, num_kv_heads=n,
                                                           causal=causal, algorithm=algorithm)
                    x = torch.randn(2, s, h, generator=torch.Generator().manual_seed(7))
                    g = torch.randn(2, s, h, generator=torch.Generator().manual_seed(8))
                    xr = x.clone().requires_grad_()
                    want = ref(xr, causal, dense)
                    (want * g).sum().backward()
                    key, value = _given(name, spec, n, causal)
                    xm = x.tensor_split(n, dim=1)[rank].clone().requires_grad_()
                    got = layer(xm, **{key: value})
                    (got * g.tensor_split(n, dim=1)[rank]).sum().backward()
                    _close(got, want.tensor_split(n, dim=1)[rank], "output")
                    _close(xm.grad, xr.grad.tensor_split(n, dim=1)[rank], "input grad")
                    for mine, theirs in (("wq", q), ("wk", k), ("wv", v), ("wo", o)):
                        _close(getattr(layer, mine).grad, theirs.weight.grad, f"{mine} grad")
                    for mine, theirs in (("bq", q), ("bo", o)):
                        _close(getattr(layer, mine).grad, theirs.bias.grad, f"{mine} grad")

                _run(results, f"{name}-{'causal' if causal else 'full'}-{algorithm}", body)
    return results


# -- commfuse.tp.AttentionParallel on a torchtitan-style block -------------------------------------------------------


class TitanAttention(nn.Module):
    """Written as torchtitan writes its attention: ``forward(x, freqs_cis, attention_masks)``."""

    def __init__(self, q, k, v, o, heads):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo, self.heads = q, k, v, o, heads

    def forward(self, x, freqs_cis, attention_masks):
        raise NotImplementedError("parallelized: commfuse.tp.AttentionParallel replaces it")


class KeywordAttention(nn.Module):
    """An attention whose masks come by keyword (``attn_mask=``, ``document_ids=``...) and no rope."""

    def __init__(self, q, k, v, o):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = q, k, v, o

    def forward(self, x, **masks):
        raise NotImplementedError("parallelized: commfuse.tp.AttentionParallel replaces it")


def attention_parallel(rank, n):
    """AttentionParallel on a torchtitan-style block, the mask as its ``attention_masks`` argument (positional,
    after freqs_cis, which goes to the rope hook), and on a block given masks by keyword with no rope hook;
    against the unsharded SDPA with the mask."""
    results = {}
    s, h = 4 * n, 8 * n
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    cache = llama.rope_cache(4, s)
    for name, (spec, dense) in _masks(n, 2 * n).items():
        for causal in (True, False):
            for how in ("titan", "keyword"):
                def body(spec=spec, dense=dense, causal=causal, how=how, name=name):
                    q, k, v, o = _projections(n, bias=False)
                    ref = _Reference(q, k, v, o, 2 * n, cache if how == "titan" else None)
                    x = torch.randn(2, s, h, generator=torch.Generator().manual_seed(7))
                    g = torch.randn(2, s, h, generator=torch.Generator().manual_seed(8))
                    xr = x.clone().requires_grad_()
                    want = ref(xr, causal, dense)
                    (want * g).sum().backward()
                    import copy

                    pq, pk, pv, po = (copy.deepcopy(m) for m in (q, k, v, o))
                    key, value = _given(name, spec, n, causal)
                    xm = x.tensor_split(n, dim=1)[rank].clone().requires_grad_()
                    if how == "titan":
                        block = TitanAttention(pq, pk, pv, po, 2 * n)
                        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4, causal=causal,
                                                                             rope=llama.apply_rope,
                                                                             algorithm="ring"))
                        got = block(xm, cache, value)
                    else:
                        block = KeywordAttention(pq, pk, pv, po)
                        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4, causal=causal,
                                                                             algorithm="ring"))
                        got = block(xm, **{key: value})
                    (got * g.tensor_split(n, dim=1)[rank]).sum().backward()
                    _close(got, want.tensor_split(n, dim=1)[rank], "output")
                    _close(xm.grad, xr.grad.tensor_split(n, dim=1)[rank], "input grad")
                    for mine, theirs in (("wq", q), ("wk", k), ("wv", v), ("wo", o)):
                        _close(getattr(block, mine).weight.grad, theirs.weight.grad, f"{mine} grad")

                if how == "titan" and name in ("document-ids", "cu-seqlens"):
                    continue  # torchtitan passes a BlockMask or a VarlenMetadata there, not ids or lengths
                _run(results, f"{name}-{'causal' if causal else 'full'}-{how}", body)
    return results


# -- what is refused, by name ---------------------------------------------------------------------------------------


def refusals(rank, n):
    """Every argument the style or the layer cannot interpret is refused by name, never ignored."""
    from commfuse.nn import ParallelAttention

    results = {}
    s, h = 4 * n, 8 * n
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    x = torch.randn(2, s, h, generator=torch.Generator().manual_seed(7)).tensor_split(n, dim=1)[rank].clone()

    def style(block_cls=KeywordAttention, rope=None):
        q, k, v, o = _projections(n, bias=False)
        block = block_cls(q, k, v, o) if block_cls is KeywordAttention else block_cls(q, k, v, o, 2 * n)
        return parallelize_module(block, mesh, tp.AttentionParallel(head_dim=4, rope=rope, algorithm="ring"))

    def no_rope():
        block = style(TitanAttention)  # freqs_cis, but no rope hook to give it to
        expect(lambda: block(x, llama.rope_cache(4, s), None), cf.errors.CommfuseTypeError,
               "freqs_cis", "no rope hook", "attention_masks")

    def rope_does_not_take_it():
        block = style(KeywordAttention, rope=llama.apply_rope)  # apply_rope(q, k, cache): no keyword 'bias'
        expect(lambda: block(x, llama.rope_cache(4, s), alibi=torch.zeros(s, s)), cf.errors.CommfuseTypeError,
               "alibi=", "apply_rope", "does not take it")

    def dict_of_masks():
        block = style(TitanAttention, rope=llama.apply_rope)
        expect(lambda: block(x, llama.rope_cache(4, s), {"global": _block_mask(n, True)}),
               cf.errors.CommfuseTypeError, "attention_masks", "dict")

    def integer_mask():
        layer = ParallelAttention(h, 2 * n, num_kv_heads=n, algorithm="ring")
        expect(lambda: layer(x, torch.ones(2, s, dtype=torch.long)), cf.errors.CommfuseTypeError,
               "attn_mask", "int64", "document_ids")

    def sharded_mask():
        layer = ParallelAttention(h, 2 * n, num_kv_heads=n, algorithm="ring")
        expect(lambda: layer(x, torch.zeros(s // n, s)), cf.errors.CommfuseValueError,
               "attn_mask", f"[{s // n}, {s}]", "whole")
        expect(lambda: layer(x, document_ids=torch.zeros(2, s // n, dtype=torch.long)), cf.errors.CommfuseValueError,
               "document_ids", "whole")

    def mask_with_gradient():
        layer = ParallelAttention(h, 2 * n, num_kv_heads=n, algorithm="ring")
        expect(lambda: layer(x, torch.zeros(s, s, requires_grad=True)), cf.errors.CommfuseValueError,
               "attn_mask", "gradient")

    def two_masks():
        layer = ParallelAttention(h, 2 * n, num_kv_heads=n, algorithm="ring")
        expect(lambda: layer(x, torch.zeros(s, s), document_ids=_document_ids(n)), cf.errors.CommfuseValueError,
               "two masks", "attn_mask", "document_ids")

    def document_across_rows():
        layer = ParallelAttention(h, 2 * n, num_kv_heads=n, algorithm="ring")
        expect(lambda: layer(x, cu_seqlens=torch.tensor([0, s + 1, 2 * s])), cf.errors.CommfuseValueError,
               "cu_seqlens", "batch row")

    def one_rank_refused():
        # rank 0 gives a mask of the wrong shape, the others a right one: rank 0 is refused by name, and the
        # others, waiting for it in the layer's rings, are told (not left to their timeout)
        layer = ParallelAttention(h, 2 * n, num_kv_heads=n, algorithm="ring")
        mask = torch.zeros(s // n, s) if rank == 0 else torch.zeros(s, s)
        try:
            layer(x, mask)
        except cf.errors.CommfuseError as e:
            text = str(e)
            if rank == 0 and "attn_mask" not in text:
                raise AssertionError(f"rank 0's error does not name the mask: {text}") from e
            if rank != 0 and ("rank 0" not in text or "TimeoutError" in type(e).__name__):
                raise AssertionError(f"rank {rank} was not told of rank 0's failure: {type(e).__name__}: "
                                     f"{text}") from e
        else:
            raise AssertionError("the layer ran with rank 0's mask refused")

    for name, fn in (("no-rope-for-an-argument", no_rope), ("rope-does-not-take-it", rope_does_not_take_it),
                     ("dict-of-masks", dict_of_masks), ("integer-mask", integer_mask), ("sharded-mask", sharded_mask),
                     ("mask-with-gradient", mask_with_gradient), ("two-masks", two_masks),
                     ("document-across-batch-rows", document_across_rows), ("one-rank-refused", one_rank_refused)):
        _run(results, name, fn)
    return results


# -- torch.compile --------------------------------------------------------------------------------------------------


def compiled(rank, n, backend):
    """ParallelAttention and AttentionParallel with masks compiled with fullgraph=True: one graph, no break, what
    eager gives (outputs and every gradient), and the output of the unsharded SDPA with the mask."""
    from commfuse.nn import ParallelAttention

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="commfuse-inductor-")
    results = {}
    s, h = 4 * n, 8 * n
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    x_full = torch.randn(2, s, h, generator=torch.Generator().manual_seed(7))
    x = x_full.tensor_split(n, dim=1)[rank].clone()

    def matches_eager(model, kwargs, reference, fullgraph=True):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x, **kwargs)
        if fullgraph and (explained.graph_count != 1 or explained.graph_break_count != 0):
            raise AssertionError(f"{explained.graph_count} graphs, {explained.graph_break_count} breaks: "
                                 f"{[str(b.reason)[:300] for b in explained.break_reasons]}")
        torch._dynamo.reset()

        def step(fn):
            for p in model.parameters():
                p.grad = None
            xx = x.clone().requires_grad_()
            y = fn(xx, **kwargs)
            y.pow(2).sum().backward()
            return y, xx.grad, [_full(p.grad) for p in model.parameters()]

        want = step(model)
        got = step(torch.compile(model, fullgraph=fullgraph, backend=backend))
        _close(got[0], reference.tensor_split(n, dim=1)[rank], "compiled output against the unsharded SDPA")
        _close(got[0], want[0], "output")
        _close(got[1], want[1], "input grad")
        for i, (a, b) in enumerate(zip(got[2], want[2])):
            _close(a, b, f"parameter {i} grad")

    masks = _masks(n, 2 * n)
    # a BlockMask is evaluated per query slice by FlexAttention's create_mask, which torch 2.9's Dynamo cannot
    # trace: there it runs at a graph break (compile without fullgraph), and must still equal eager
    traced = _traces_create_mask()
    for name in ("additive-per-head", "boolean", "document-ids", "block-mask"):
        spec, dense = masks[name]
        fullgraph = name != "block-mask" or traced

        def reference(q, k, v, o, dense=dense):
            with torch.no_grad():
                return _Reference(q, k, v, o, 2 * n)(x_full, True, dense)

        def layer(spec=spec, name=name):
            q, k, v, o = _projections(n, bias=True)
            model = ParallelAttention.from_linears(q, k, v, o, num_heads=2 * n, num_kv_heads=n, algorithm="ring")
            key, value = _given(name, spec, n, True)
            matches_eager(model, {key: value}, reference(q, k, v, o), fullgraph)

        def style(spec=spec, name=name):
            import copy

            q, k, v, o = _projections(n, bias=False)
            want = reference(q, k, v, o)
            block = parallelize_module(KeywordAttention(*(copy.deepcopy(m) for m in (q, k, v, o))), mesh,
                                       tp.AttentionParallel(head_dim=4, algorithm="ring"))
            key, value = _given(name, spec, n, True)
            matches_eager(block, {key: value}, want, fullgraph)

        _run(results, f"ParallelAttention-{name}", layer)
        _run(results, f"AttentionParallel-{name}", style)
    return results


def _traces_create_mask() -> bool:
    """Whether this torch's Dynamo traces FlexAttention's create_mask (torch 2.9's does not: it cannot take the
    mask_mod's inspect.signature)."""
    from torch.nn.attention.flex_attention import create_mask

    def f(x):
        return x + create_mask(lambda b, h, q, kv: q >= kv, 1, 1, 2, 2, "cpu").sum()

    torch._dynamo.reset()
    try:
        torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(()))
        return True
    except Exception:  # noqa: BLE001 - Dynamo's Unsupported, in whatever wrapper this torch gives it
        return False
    finally:
        torch._dynamo.reset()
