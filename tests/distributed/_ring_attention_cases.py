"""Rank-side bodies of the ring attention tests: commfuse.ring_attention and commfuse.nn.RingAttention on this
rank's sequence shard against the unsharded attention in float64 (forward, dq, dk, dv), against torch's own
ring attention (torch.distributed.tensor.experimental's), under torch.compile, and the inputs refused by name.
Each body runs many checks in one spawned run and returns {check name: None or the error}."""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch

import commfuse as cf
from commfuse.context import rope, shard_sequence
from commfuse.errors import CommfuseError
from commfuse.fused.attention import attend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_cases import _run, expect  # noqa: E402  (the shared rank-side runner)

#: (atol, rtol) against the float64 reference: float32 merges in another order; bfloat16 is rounded once at
#: the end (blocks are computed and merged in float32), so its bound is a few of its ulps at values ~1
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
ALGORITHMS = ("ring", "bidirectional", "vanilla", "auto", "ring:2", "ring:3")


def documents(seq: int) -> list[int]:
    """Document lengths over ``seq`` positions whose boundaries fall inside shards and across them."""
    return [3, seq - 5, 2]


def row_documents(seq: int) -> list[list[int]]:
    """Per-row document lengths for a batch of 2 (packed rows whose documents differ): row 0 as
    :func:`documents`, row 1 cut elsewhere, with a one-position document."""
    return [documents(seq), [seq // 2 - 1, 1, seq - seq // 2]]


def _same_document(lengths) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:, None] == ids[None, :]


def reference(q, k, v, causal: bool, lengths):
    """Plain attention of the whole sequence (``attend``: SDPA with K/V heads repeated), masked to documents
    (one list for every row, or one per row)."""
    mask = None
    if lengths is not None:
        if isinstance(lengths[0], int):
            mask = _same_document(lengths)[None, None]
        else:
            mask = torch.stack([_same_document(row) for row in lengths])[:, None]
    return attend(q, k, v, causal=causal, mask=mask)


def _close(got, want, what, dtype):
    atol, rtol = TOL[dtype]
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if not torch.allclose(got, want, atol=atol, rtol=rtol):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g}")


def _inputs(n, seq_per_rank, hq, hkv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    s = seq_per_rank * n
    q, k, v = (torch.randn(2, s, h, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    # the inputs as the ranks hold them (rounded to dtype), and the reference on exactly those values
    return [t.to(dtype).double().requires_grad_() for t in (q, k, v)]


def numerics(rank: int, n: int) -> dict:
    """Forward and backward against the float64 unsharded attention, over layouts, masks, heads, dtypes and
    algorithms; and against torch's ring attention."""
    torch.set_num_threads(1)
    results: dict = {}
    i = 0
    for layout in ("contiguous", "zigzag"):
        for causal in (True, False):
            for hq, hkv in ((4, 4), (4, 2)):
                for docs in (False, True):
                    for dtype in (torch.float32, torch.bfloat16):
                        algorithm = ALGORITHMS[i % len(ALGORITHMS)]
                        i += 1
                        if docs:  # documents shared by the batch's rows, or per row: zigzag float32, contiguous bf16
                            docs = "rowdocs" if (layout == "zigzag") == (dtype == torch.float32) else "docs"
                        name = (f"{layout}-{'causal' if causal else 'full'}-{hq}x{hkv}-"
                                f"{docs or 'nodocs'}-{str(dtype)[6:]}-{algorithm}")
                        _run(results, name, _bind(_one, rank, n, layout, causal, hq, hkv, docs, dtype, algorithm,
                                                  i))
    cp = _torch_ring()
    if isinstance(cp, str):
        results["skip:torch-ring-attention"] = cp
    else:
        _run(results, "torch-ring-attention", lambda: _against_torch(rank, n, cp))
    return results


def _torch_ring():
    """torch's ring attention module, or why it cannot be compared with (the bench's finder: one place knows
    where each torch keeps it)."""
    from commfuse.bench.workloads import torch_ring_module

    return torch_ring_module()


def _bind(fn, *args):
    return lambda: fn(*args)


def _one(rank, n, layout, causal, hq, hkv, docs, dtype, algorithm, seed):
    q, k, v = _inputs(n, 4, hq, hkv, dtype, seed)
    lengths = None if not docs else row_documents(q.shape[1]) if docs == "rowdocs" else documents(q.shape[1])
    want = reference(q, k, v, causal, lengths)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1000), dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    mine = [shard_sequence(t.detach(), rank, n, layout).to(dtype).requires_grad_() for t in (q, k, v)]
    got = cf.ring_attention(*mine, causal=causal, layout=layout, algorithm=algorithm, document_lengths=lengths)
    if got.dtype != dtype or got.shape != mine[0].shape:
        raise AssertionError(f"output {got.dtype}{list(got.shape)}, want {dtype}{list(mine[0].shape)}")
    _close(got, shard_sequence(want, rank, n, layout), "output", dtype)
    got.backward(shard_sequence(dout, rank, n, layout).to(dtype))
    for t, w, name in zip(mine, want_grads, ("dq", "dk", "dv")):
        if t.grad.dtype != dtype:
            raise AssertionError(f"{name} has dtype {t.grad.dtype}, want {dtype}")
        _close(t.grad, shard_sequence(w, rank, n, layout), name, dtype)


def _against_torch(rank, n, cp):
    """torch's ring attention (the one ``context_parallel`` dispatches SDPA to) on the same shards: its public
    ``context_parallel`` cannot run on CPU (no DTensor sharding strategy for
    ``aten._scaled_dot_product_flash_attention_for_cpu``), so its ring, ``_templated_ring_attention``, is
    called directly with the CPU flash kernel; its load balancing is the zigzag layout. Forward only."""
    import torch.distributed as dist

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    saved = cp._cp_options.enable_load_balance
    try:
        for layout in ("contiguous", "zigzag"):
            for causal in (True, False):
                q, k, v = (t.detach().float() for t in _inputs(n, 4, 2, 2, torch.float32, 7))
                mine = [shard_sequence(t, rank, n, layout) for t in (q, k, v)]
                # its load balancing (zigzag) is for causal attention only; full attention needs no layout
                cp._cp_options.enable_load_balance = layout == "zigzag" and causal
                theirs, *_ = cp._templated_ring_attention(dist.group.WORLD, 2, flash,
                                                          *(t.transpose(1, 2) for t in mine), is_causal=causal)
                got = cf.ring_attention(*mine, causal=causal, layout=layout, algorithm="ring")
                _close(got, theirs.transpose(1, 2), f"{layout}-{'causal' if causal else 'full'} vs torch",
                       torch.float32)
    finally:
        cp._cp_options.enable_load_balance = saved


def layer_and_refusals(rank: int, n: int) -> dict:
    """commfuse.nn.RingAttention against the unsharded layer (forward, input and weight gradients), eager and
    compiled; then the inputs refused by name."""
    torch.set_num_threads(1)
    results: dict = {}
    _run(results, "layer-zigzag-gqa", lambda: _layer(rank, n, "zigzag", compiled=False))
    _run(results, "layer-contiguous-compiled", lambda: _layer(rank, n, "contiguous", compiled=True))
    _run(results, "refusals", lambda: _refusals(rank, n))
    return results


def _layer(rank, n, layout, compiled):
    from commfuse.nn import RingAttention

    torch.manual_seed(3)
    layer = RingAttention(16, 4, num_kv_heads=2, layout=layout)
    s = 4 * n
    x = torch.randn(2, s, 16, dtype=torch.float64)
    lengths = documents(s)

    def whole(x):  # the unsharded layer: the same weights, positions 0..s-1
        b = x.shape[0]
        q, k, v = (p(x).view(b, s, -1, 4) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        pos = torch.arange(s)
        return layer.o_proj(reference(rope(q, pos), rope(k, pos), v, True, lengths).reshape(b, s, -1))

    layer.double()
    xx = x.clone().requires_grad_()
    want = whole(xx)
    want.pow(2).sum().backward()
    want_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    mine = shard_sequence(x, rank, n, layout).requires_grad_()
    run = layer
    if compiled:
        torch._dynamo.reset()
        expect(lambda: torch.compile(layer, backend="aot_eager", fullgraph=True)(mine, lengths), Exception,
               "cannot be part of a torch.compile graph")
        torch._dynamo.reset()
        run = torch.compile(layer, backend="aot_eager")
    got = run(mine, lengths)
    tol = dict(atol=1e-10, rtol=1e-8)
    if not torch.allclose(got, shard_sequence(want, rank, n, layout), **tol):
        raise AssertionError("the layer's output differs from the unsharded layer's")
    # each rank's loss is its shard's: their sum is the whole loss, whose gradients the replicated weights get
    got.pow(2).sum().backward()
    if not torch.allclose(mine.grad, shard_sequence(xx.grad, rank, n, layout), **tol):
        raise AssertionError("the input gradient differs from the unsharded layer's")
    for name, p in layer.named_parameters():
        if not torch.allclose(p.grad, want_grads[name], **tol):
            raise AssertionError(f"{name}.grad differs by {(p.grad - want_grads[name]).abs().max().item():.3g}")
    if compiled:  # and the compiled layer equals the eager one
        layer.zero_grad()
        eager = layer(mine.detach(), lengths)
        if not torch.allclose(eager, got, **tol):
            raise AssertionError("the compiled layer differs from the eager one")


def _refusals(rank, n):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 4, 8, generator=g), torch.randn(1, 4, 2, 8, generator=g)
    ra = cf.ring_attention
    expect(lambda: ra(q, torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)), CommfuseError, f"rank {rank}",
           "[1, 4, 4, 8]", "[1, 6, 2, 8]")
    expect(lambda: ra(q, k, torch.randn(1, 4, 3, 8)), CommfuseError, f"rank {rank}", "[1, 4, 3, 8]")
    expect(lambda: ra(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8)), CommfuseError, f"rank {rank}",
           "4 heads", "3")
    expect(lambda: ra(q[:, :3], k[:, :3], k[:, :3], layout="zigzag"), CommfuseError, f"rank {rank}",
           f"{3 * n} positions", f"{2 * n} equal chunks", f"world size {n}")
    expect(lambda: ra(q, k, k, document_lengths=[1, 2]), CommfuseError, f"rank {rank}", "sum to 3",
           f"{4 * n} positions")
    expect(lambda: ra(q, k, k, document_lengths=[4 * n - 1, 0, 1]), CommfuseError, "document_lengths[1] = 0")
    expect(lambda: ra(q, k, k, layout="striped"), CommfuseError, "'striped'", "contiguous, zigzag")
    # after the refusals the group is still in step
    got = ra(q, k, k, layout="zigzag")
    if got.shape != q.shape:
        raise AssertionError("a call after the refusals failed")


def error_growth(rank: int, n: int) -> dict:
    """The largest error of this rank's output against float64 (causal, zigzag, ring), by dtype: for the
    check that it does not grow with the world size."""
    torch.set_num_threads(1)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.detach() for t in _inputs(n, 2, 2, 2, dtype, 11))
        want = reference(q, k, v, True, None)
        mine = [shard_sequence(t, rank, n, "zigzag").to(dtype) for t in (q, k, v)]
        got = cf.ring_attention(*mine, causal=True, layout="zigzag", algorithm="ring")
        errors[str(dtype)[6:]] = (got.double() - shard_sequence(want, rank, n, "zigzag")).abs().max().item()
    return errors


def mesh_2d(rank: int, n: int):
    """A cp x ulysses mesh of 2 x n/2: (cp size, ulysses size, this rank's cp rank and ulysses rank, its cp group,
    its Ulysses group). rank = cp_rank * u_size + u_rank: the Ulysses groups are consecutive ranks, the cp
    groups strided. Every rank makes every group, in one order."""
    import torch.distributed as dist

    cp_size, u_size = 2, n // 2
    u_groups = [dist.new_group(list(range(c * u_size, (c + 1) * u_size))) for c in range(cp_size)]
    cp_groups = [dist.new_group(list(range(u, n, u_size))) for u in range(u_size)]
    cp_rank, u_rank = divmod(rank, u_size)
    return cp_size, u_size, cp_rank, u_rank, cp_groups[u_rank], u_groups[cp_rank]


def two_dimensional(rank: int, n: int) -> dict:
    """The 2-D form on a cp x ulysses mesh of 2 x 2 (n = 4): ring attention over the cp axis with Ulysses
    inside, forward and dq/dk/dv against the float64 unsharded attention; and RingAttention with a Ulysses
    group against the unsharded layer (input and weight gradients too)."""
    from commfuse.fused.ring_attention import ulysses_positions

    torch.set_num_threads(1)
    results: dict = {}
    cp_size, u_size, cp_rank, u_rank, cp_group, u_group = mesh_2d(rank, n)

    def mine(t, seq):
        return t[:, ulysses_positions(seq, cp_rank, cp_size, u_rank, u_size, layout)]

    def attention(causal, docs, dtype, algorithm):
        q, k, v = _inputs(n, 4, 4, 2, dtype, 5)
        seq = q.shape[1]
        lengths = documents(seq) if docs else None
        want = reference(q, k, v, causal, lengths)
        dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        ins = [mine(t.detach(), seq).to(dtype).requires_grad_() for t in (q, k, v)]
        got = cf.ring_attention(*ins, group=cp_group, ulysses_group=u_group, causal=causal, layout=layout,
                                algorithm=algorithm, document_lengths=lengths)
        _close(got, mine(want, seq), "output", dtype)
        got.backward(mine(dout, seq).to(dtype))
        for t, w, name in zip(ins, want_grads, ("dq", "dk", "dv")):
            _close(t.grad, mine(w, seq), name, dtype)

    for layout in ("contiguous", "zigzag"):
        for causal, docs, dtype, algorithm in ((True, False, torch.float32, "ring"), (True, True, torch.float32,
                                               "vanilla"), (False, False, torch.bfloat16, "bidirectional")):
            _run(results, f"2d-{layout}-{causal}-{docs}-{str(dtype)[6:]}-{algorithm}",
                 _bind(attention, causal, docs, dtype, algorithm))

    def layer():
        from commfuse.nn import RingAttention

        layout = "zigzag"
        torch.manual_seed(3)
        m = RingAttention(16, 4, num_kv_heads=2, layout=layout, group=cp_group, ulysses_group=u_group).double()
        s = 4 * n
        x = torch.randn(2, s, 16, dtype=torch.float64)
        xx = x.clone().requires_grad_()
        b = x.shape[0]
        q, k, v = (p(xx).view(b, s, -1, 4) for p in (m.q_proj, m.k_proj, m.v_proj))
        pos = torch.arange(s)
        want = m.o_proj(reference(rope(q, pos), rope(k, pos), v, True, None).reshape(b, s, -1))
        want.pow(2).sum().backward()
        want_grads = {name: p.grad.clone() for name, p in m.named_parameters()}
        m.zero_grad()
        ins = x[:, ulysses_positions(s, cp_rank, cp_size, u_rank, u_size, layout)].requires_grad_()
        got = m(ins)
        _close(got, want[:, ulysses_positions(s, cp_rank, cp_size, u_rank, u_size, layout)], "layer output",
               torch.float32)
        got.pow(2).sum().backward()
        _close(ins.grad, xx.grad[:, ulysses_positions(s, cp_rank, cp_size, u_rank, u_size, layout)], "input grad",
               torch.float32)
        for name, p in m.named_parameters():
            _close(p.grad, want_grads[name], f"{name}.grad", torch.float32)

    _run(results, "2d-layer", layer)

    def refused():
        q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 1, 8)
        expect(lambda: cf.ring_attention(q, k, k, group=cp_group, ulysses_group=u_group), CommfuseError,
               f"rank {u_rank}", "k has 1 heads", f"Ulysses group's size {u_size}")
        got = cf.ring_attention(q, q, q, group=cp_group, ulysses_group=u_group)  # and the groups are in step
        if got.shape != q.shape:
            raise AssertionError("a call after the refusal failed")

    _run(results, "2d-refuses-heads-that-do-not-divide", refused)
    return results


# -- commfuse.tp.RingAttentionParallel on a Llama-style block, and bf16 autocast -----------------------------------


#: bf16 autocast against the unsharded layer under autocast: the largest difference over the largest value, at
#: most 8 bf16 ulps (2**-8 each); the largest seen on 2 and 3 ranks is 1.45e-2 (an input gradient)
_BF16 = 3e-2


def _close_bf16(got, want, what):
    err, scale = (got.double() - want.double()).abs().max().item(), want.double().abs().max().item()
    if err > _BF16 * scale:
        raise AssertionError(f"{what}: max diff {err:.3g}, over {_BF16} of its largest value {scale:.3g}")


def _titan_block():
    """torchtitan's GQAttention shape (fused wqkv, a RoPE module called rope(xq, xk, positions)), from the tp
    tests: ``forward(x, attention_masks, positions=None)``."""
    from _tp_cases import _TitanAttention

    return _TitanAttention(dim=16, n_heads=4, n_kv_heads=2, fused=True)


def _cache_rope(q, k, cache, *, positions):
    """The rope hook of commfuse.models.llama's block under CP: its (cos, sin) cache covers the whole sequence;
    this rank's rows are its tokens' global positions."""
    from commfuse.models import llama

    cos, sin = cache
    return llama.apply_rope(q, k, (cos[positions], sin[positions]))


def _titan_rope(q, k, positions=None, *, module):
    return module.rope(q, k, positions)


def _style_case(rank, n, layout, kind, dtype=torch.float64, autocast=False, sum_grads=True, ddp=False,
                fsdp=False):
    """The block with commfuse.tp.RingAttentionParallel on this rank's shard against the same block unsharded on
    the whole sequence: output, input gradient and every weight gradient (the whole loss's, summed over the
    ranks; with DDP, or torch's fully_shard, over the group and sum_grads=False, their average of it: each
    rank's own gradient is its shard's part, and the average of the parts is 1/N of the whole)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse import tp
    from commfuse.models import llama

    s, dim = 4 * n, 16
    torch.manual_seed(7)
    if kind == "llama":
        base = llama.Attention(dim, 4, 2)  # grouped-query: 4 query heads, 2 K/V heads
        cache = llama.rope_cache(4, s)
        args = (cache,)
        style = tp.RingAttentionParallel(head_dim=4, layout=layout, rope=_cache_rope, algorithm="ring",
                                         sum_grads=sum_grads)
    else:
        base = _titan_block()
        args = (None,)
        style = tp.RingAttentionParallel(head_dim=base.wo.in_features // 4, qkv="qkv_linear.wqkv", layout=layout,
                                         rope=_titan_rope, rope_takes_module=True, sum_grads=sum_grads)
    block = copy.deepcopy(base)
    base, block = base.to(dtype), block.to(dtype)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, s, dim, generator=g, dtype=dtype)
    dy = torch.randn(2, s, dim, generator=g, dtype=dtype)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    xx = x.clone().requires_grad_()
    with ctx():
        want = base(xx, *args)
    (want.float() * dy.float()).sum().backward()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    parallelize_module(block, mesh["cp"], style)
    run = block
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(block, process_group=mesh.get_group())
    if fsdp:  # the style first, then FSDP2 over the same ranks (torchtitan's dp_shard_cp): weights Shard(0)
        from torch.distributed.fsdp import fully_shard

        fully_shard(block, mesh=mesh["cp"])
    mine = shard_sequence(x, rank, n, layout).requires_grad_()
    with ctx():
        got = run(mine, *args)
    (got.float() * shard_sequence(dy, rank, n, layout).float()).sum().backward()
    if autocast:  # bf16 GEMMs on both sides, summed in other orders: _BF16 of the largest value
        if got.dtype != torch.bfloat16:
            raise AssertionError(f"under autocast the block's output is {got.dtype}, not torch.bfloat16")
        close = _close_bf16
    else:
        def close(a, b, what):
            if a.shape != b.shape or not torch.allclose(a, b, atol=1e-10, rtol=1e-8):
                raise AssertionError(f"{what}: max diff {(a - b).abs().max().item():.3g}")
    close(got, shard_sequence(want, rank, n, layout), "output")
    close(mine.grad, shard_sequence(xx.grad, rank, n, layout), "input grad")
    factor = 1.0 / n if (ddp or fsdp) and not sum_grads else 1.0  # DDP and FSDP average the ranks' gradients
    for (name, p), (_, w) in zip(block.named_parameters(), base.named_parameters()):
        if p.grad is None or p.grad.dtype != w.dtype:
            raise AssertionError(f"{name}.grad is {None if p.grad is None else p.grad.dtype}, want {w.dtype}")
        grad = p.grad
        if fsdp:  # FSDP2 leaves each rank its Shard(0) rows of the reduce-scattered gradient
            if not isinstance(grad, DTensor):
                raise AssertionError(f"under fully_shard {name}.grad is a {type(grad).__name__}, not a DTensor")
            grad = grad.full_tensor()
        close(grad, w.grad * factor, f"{name}.grad")


def _style_refusals(rank, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse import tp
    from commfuse.errors import CommfuseTypeError
    from commfuse.models import llama

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    expect(lambda: tp.RingAttentionParallel(head_dim=4, rope=llama.apply_rope), CommfuseTypeError,
           "RingAttentionParallel", "takes no keyword 'positions'")
    expect(lambda: tp.RingAttentionParallel(head_dim=4, layout="striped"), CommfuseError, "'striped'")
    torch.manual_seed(7)
    block = llama.Attention(16, 4, 2)
    parallelize_module(block, mesh["cp"], tp.RingAttentionParallel(head_dim=4, layout="zigzag", rope=_cache_rope))
    cache = llama.rope_cache(4, 4 * n)
    x = torch.randn(2, 4, 16)
    expect(lambda: block(x, cache, attn_mask=torch.ones(4 * n, 4 * n, dtype=torch.bool)), CommfuseError,
           "RingAttentionParallel", "attn_mask", "document_lengths=")
    expect(lambda: block(x[:, :3], cache), CommfuseError, f"rank {rank}", f"{3 * n} positions",
           f"{2 * n} equal chunks")
    whole = DTensor.from_local(x, mesh["cp"], [Replicate()], run_check=False)
    expect(lambda: block(whole, cache), CommfuseError, "RingAttentionParallel", "Replicate()", "Shard(1)")
    titan = _titan_block()
    parallelize_module(titan, mesh["cp"], tp.RingAttentionParallel(head_dim=titan.wo.in_features // 4,
                                                                   qkv="qkv_linear.wqkv", rope=_titan_rope,
                                                                   rope_takes_module=True))
    expect(lambda: titan(x, None, torch.arange(4)), CommfuseError, "positions=", "commfuse.context.positions")
    # after the refusals the group is in step: a DTensor Shard(1) input (a local output), with documents
    sharded = DTensor.from_local(x, mesh["cp"], [Shard(1)], run_check=False)
    y = block(sharded, cache, document_lengths=documents(4 * n))
    if isinstance(y, DTensor) or y.shape != x.shape:
        raise AssertionError(f"the call after the refusals gave {type(y).__name__} {list(y.shape)}")


def _style_documents(rank, n, layout):
    """Documents through the block's call (document_lengths=): against the unsharded block's projections with
    float64 attention masked to the documents."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse import tp
    from commfuse.models import llama

    s = 4 * n
    torch.manual_seed(7)
    block = llama.Attention(16, 4, 2).double()
    cache = llama.rope_cache(4, s)
    x = torch.randn(2, s, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    lengths = documents(s)
    q, k, v = (p(x).view(2, s, -1, 4) for p in (block.wq, block.wk, block.wv))
    q, k = llama.apply_rope(q, k, cache)
    want = block.wo(reference(q, k, v, True, lengths).reshape(2, s, -1))
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    parallelize_module(block, mesh["cp"], tp.RingAttentionParallel(head_dim=4, layout=layout, rope=_cache_rope))
    got = block(shard_sequence(x, rank, n, layout), cache, document_lengths=lengths)
    if not torch.allclose(got, shard_sequence(want, rank, n, layout), atol=1e-10, rtol=1e-8):
        raise AssertionError("the block with documents differs from the unsharded attention")


def style(rank: int, n: int) -> dict:
    """commfuse.tp.RingAttentionParallel on a Llama-style block (GQA, RoPE by the hook) against the unsharded
    block, contiguous and zigzag; on torchtitan's shape (fused wqkv, its RoPE module); with DDP over the cp
    group; with documents; and its refusals."""
    torch.set_num_threads(1)
    results: dict = {}
    for layout in ("contiguous", "zigzag"):
        _run(results, f"style-llama-{layout}", _bind(_style_case, rank, n, layout, "llama"))
    _run(results, "style-titan-zigzag", _bind(_style_case, rank, n, "zigzag", "titan"))
    _run(results, "style-documents-zigzag", _bind(_style_documents, rank, n, "zigzag"))
    # exactly one reduction over the cp axis: the style's (sum_grads=True), or DDP's average (sum_grads=False);
    # both on at once averages equal sums, which changes nothing
    _run(results, "style-ddp-sum_grads=False", _bind(_style_case, rank, n, "zigzag", "llama", torch.float64, False,
                                                     False, True))
    _run(results, "style-ddp-sum_grads=True", _bind(_style_case, rank, n, "contiguous", "llama", torch.float64,
                                                    False, True, True))
    # the same rule with FSDP2 (torch's fully_shard after the style, over the cp ranks)
    _run(results, "style-fsdp-sum_grads=False", _bind(_style_case, rank, n, "zigzag", "llama", torch.float64,
                                                      False, False, False, True))
    _run(results, "style-fsdp-sum_grads=True", _bind(_style_case, rank, n, "contiguous", "titan", torch.float64,
                                                     False, True, False, True))
    _run(results, "style-refusals", lambda: _style_refusals(rank, n))
    return results


def _autocast_op(rank, n, layout):
    """commfuse.ring_attention on float32 inputs under CPU bf16 autocast equals it on the same values cast to
    bfloat16 outside autocast, bit for bit: the inputs are cast at entry, the blocks computed and merged in
    float32, the result bfloat16; the gradients are the bfloat16 ones, in float32."""
    q, k, v = (t.detach().float() for t in _inputs(n, 4, 4, 2, torch.float32, 21))
    mine = [shard_sequence(t, rank, n, layout).requires_grad_() for t in (q, k, v)]
    cast = [t.detach().bfloat16().requires_grad_() for t in mine]
    dout = torch.randn(mine[0].shape, generator=torch.Generator().manual_seed(rank)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cf.ring_attention(*mine, layout=layout, algorithm="ring")
    got.backward(dout)
    want = cf.ring_attention(*cast, layout=layout, algorithm="ring")
    want.backward(dout)
    if got.dtype != torch.bfloat16 or not torch.equal(got, want):
        raise AssertionError(f"under autocast: {got.dtype}, max diff {(got.float() - want.float()).abs().max()}")
    for a, b, name in zip(mine, cast, ("dq", "dk", "dv")):
        if a.grad.dtype != torch.float32 or not torch.equal(a.grad, b.grad.float()):
            raise AssertionError(f"{name} under autocast differs from the bfloat16 inputs' {name}")


def _autocast_layer(rank, n, layout):
    """commfuse.nn.RingAttention under CPU bf16 autocast against the same layer's weights unsharded (torch's
    linears and SDPA) under autocast: output in bfloat16, input and weight gradients, within _BF16 of
    the largest value (both sides round their GEMMs to bf16 and sum them in other orders)."""
    from commfuse.nn import RingAttention

    torch.manual_seed(3)
    layer = RingAttention(16, 4, num_kv_heads=2, layout=layout)
    s = 4 * n
    g = torch.Generator().manual_seed(8)
    x, dy = torch.randn(2, s, 16, generator=g), torch.randn(2, s, 16, generator=g)
    xx = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qw, kw, vw = (p(xx).view(2, s, -1, 4) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        pos = torch.arange(s)
        want = layer.o_proj(reference(rope(qw, pos), rope(kw, pos), vw, True, None).reshape(2, s, -1))
    (want.float() * dy).sum().backward()
    want_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    mine = shard_sequence(x, rank, n, layout).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(mine)
    (got.float() * shard_sequence(dy, rank, n, layout)).sum().backward()
    if got.dtype != torch.bfloat16:
        raise AssertionError(f"under autocast the layer's output is {got.dtype}")
    pairs = [("output", got, shard_sequence(want, rank, n, layout)),
             ("input grad", mine.grad, shard_sequence(xx.grad, rank, n, layout))]
    pairs += [(f"{name}.grad", p.grad, want_grads[name]) for name, p in layer.named_parameters()]
    for what, a, b in pairs:
        _close_bf16(a, b, what)


def autocast(rank: int, n: int) -> dict:
    """bf16 autocast on CPU: the op (bit-exact against bfloat16 inputs), the RingAttention layer and the
    RingAttentionParallel style (against the unsharded layer or block under autocast)."""
    torch.set_num_threads(1)
    results: dict = {}
    _run(results, "autocast-op-zigzag", _bind(_autocast_op, rank, n, "zigzag"))
    _run(results, "autocast-op-contiguous", _bind(_autocast_op, rank, n, "contiguous"))
    _run(results, "autocast-layer-zigzag", _bind(_autocast_layer, rank, n, "zigzag"))
    _run(results, "autocast-style-llama-zigzag", _bind(_style_case, rank, n, "zigzag", "llama", torch.float32, True))
    return results
