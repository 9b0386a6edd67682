"""Rank-side bodies of the ring attention tests: commfuse.ring_attention and commfuse.nn.RingAttention on this
rank's sequence shard against the unsharded attention in float64 (forward, dq, dk, dv), against torch's own
ring attention (torch.distributed.tensor.experimental's), under torch.compile, and the inputs refused by name.
Each body runs many checks in one spawned run and returns {check name: None or the error}."""

from __future__ import annotations

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
ALGORITHMS = ("ring", "bidirectional", "vanilla", "auto")


def documents(seq: int) -> list[int]:
    """Document lengths over ``seq`` positions whose boundaries fall inside shards and across them."""
    return [3, seq - 5, 2]


def reference(q, k, v, causal: bool, lengths):
    """Plain attention of the whole sequence (``attend``: SDPA with K/V heads repeated), masked to documents."""
    mask = None
    if lengths is not None:
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        mask = (ids[:, None] == ids[None, :])[None, None]
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
                        name = (f"{layout}-{'causal' if causal else 'full'}-{hq}x{hkv}-"
                                f"{'docs' if docs else 'nodocs'}-{str(dtype)[6:]}-{algorithm}")
                        _run(results, name, _bind(_one, rank, n, layout, causal, hq, hkv, docs, dtype, algorithm,
                                                  i))
    cp = _torch_ring()
    if isinstance(cp, str):
        results["skip:torch-ring-attention"] = cp
    else:
        _run(results, "torch-ring-attention", lambda: _against_torch(rank, n, cp))
    return results


def _torch_ring():
    """torch's ring attention module (private: ``_context_parallel._attention`` since torch 2.10, ``_attention``
    before), or why it cannot be compared with."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError:
        try:
            from torch.distributed.tensor.experimental import _attention as cp
        except ImportError as e:
            return f"this torch has no ring attention module to compare with ({e})"
    if not hasattr(cp, "_templated_ring_attention") or not hasattr(cp, "_cp_options") or not hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "this torch's ring attention has no _templated_ring_attention/_cp_options or CPU flash kernel"
    return cp


def _bind(fn, *args):
    return lambda: fn(*args)


def _one(rank, n, layout, causal, hq, hkv, docs, dtype, algorithm, seed):
    q, k, v = _inputs(n, 4, hq, hkv, dtype, seed)
    lengths = documents(q.shape[1]) if docs else None
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


def two_dimensional(rank: int, n: int) -> dict:
    """The 2-D form on a cp x ulysses mesh of 2 x 2 (n = 4): ring attention over the cp axis with Ulysses
    inside, forward and dq/dk/dv against the float64 unsharded attention; and RingAttention with a Ulysses
    group against the unsharded layer (input and weight gradients too)."""
    import torch.distributed as dist

    from commfuse.fused.ring_attention import ulysses_positions

    torch.set_num_threads(1)
    results: dict = {}
    cp_size, u_size = 2, n // 2
    # rank = cp_rank * u_size + u_rank: the Ulysses groups are consecutive ranks, the cp groups strided
    u_groups = [dist.new_group(list(range(c * u_size, (c + 1) * u_size))) for c in range(cp_size)]
    cp_groups = [dist.new_group(list(range(u, n, u_size))) for u in range(u_size)]
    cp_rank, u_rank = divmod(rank, u_size)
    cp_group, u_group = cp_groups[u_rank], u_groups[cp_rank]

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
