"""Rank-side bodies of the distributed tests (run inside ``commfuse.launch`` processes).

Each battery runs many cases in one process group and returns
``{case_name: None | "error text"}``, so one launch (a few seconds of process
start-up on 2 cores) serves dozens of pytest cases.
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

import commfuse as cf
from commfuse.errors import CommfuseError, CommfuseTimeoutError, MismatchError
from commfuse.runtime.c10d import lacks_all_to_all

ALGORITHMS = ["ring", "ring:2", "bidirectional", "sliced:2", "sliced:4", "vanilla", "auto"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(shape, dtype, seed, exact):
    g = _gen(seed)
    if exact:  # integer-valued in {-1, 0, 1}: every sum here is exact in fp32 and bf16
        return torch.randint(-1, 2, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _close(got, want, dtype, exact, what):
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if exact:
        if not torch.equal(got, want.to(got.dtype)):
            raise AssertionError(f"{what}: not bit-exact; max diff {(got.float() - want.float()).abs().max()}")
        return
    if got.numel() == 0:
        return
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = max(want.float().abs().max().item(), 1.0)
    diff = (got.float() - want.float()).abs().max().item()
    if diff > tol * scale:
        raise AssertionError(f"{what}: max diff {diff} > {tol} x {scale}")


def _run(results, name, fn):
    try:
        fn()
        results[name] = None
    except Exception as e:  # reported per case
        results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"


def torch_all_to_all(outputs, inputs, group=None):
    """torch's all-to-all of tensor lists into ``outputs``, the tests' reference. Where the backend lacks it
    (gloo on torch 2.9 and 2.11 refuses ``dist.all_to_all``), torch's one-tensor form over the blocks laid
    end to end, ``dist.all_to_all_single``, which gloo has there: a reference that is still torch's own
    collective, not commfuse's pairwise fallback."""
    try:
        dist.all_to_all(outputs, [x.contiguous() for x in inputs], group=group)
        return
    except RuntimeError as e:
        if not lacks_all_to_all(e):
            raise
    sizes = [x.numel() for x in inputs]
    into = [o.numel() for o in outputs]
    flat = torch.empty(sum(into), dtype=outputs[0].dtype, device=outputs[0].device)
    dist.all_to_all_single(flat, torch.cat([x.reshape(-1) for x in inputs]), into, sizes, group=group)
    for o, piece in zip(outputs, flat.split(into)):
        o.copy_(piece.view_as(o))


def _group_name(group):
    return group.group_name if group is not None else dist.group.WORLD.group_name


# -- the op matrix ----------------------------------------------------------


def ag_case(rank, n, alg, dtype, dim, exact, group=None):
    """all_gather_matmul vs the single-process reference and vs torch's fused fallback."""
    shape = [2, 6, 16]  # (batch, seq shard, hidden)
    dim = dim % 3
    full_shape = list(shape)
    full_shape[dim] *= n
    k = full_shape[-1] if dim == 2 else shape[-1]
    A = _data(full_shape, dtype, 1, exact)
    B = _data([k, 12], dtype, 2, exact)
    B2 = _data([k, 5], dtype, 3, exact)
    shard = A.tensor_split(n, dim=dim)[rank]
    rep = {}
    gathered, (y, y2) = cf.all_gather_matmul(shard, [B, B2], gather_dim=dim, algorithm=alg, group=group,
                                             return_gathered=True, report=rep, timeout=30)
    if not torch.equal(gathered, A):
        raise AssertionError("gathered a is not bit-exact")
    ref = torch.matmul(A.float(), B.float())
    _close(y, ref, dtype, exact, "result vs reference")
    _close(y2, torch.matmul(A.float(), B2.float()), dtype, exact, "second weight vs reference")
    # torch's own definition, through its collectives
    from torch.distributed._symmetric_memory import _fused_all_gather_matmul_fallback

    try:
        a_torch, (y_torch,) = _fused_all_gather_matmul_fallback(shard.contiguous(), [B], dim, _group_name(group))
    except RuntimeError as e:
        # torch 2.9's fallback has no case for a gather along the last (contraction) dim, which pytorch PR
        # 163068 added later: it multiplies shapes that do not fit. There is no torch definition to compare
        # with there; the single-process reference above still holds the result.
        if dim != 2 or "cannot be multiplied" not in str(e):
            raise
    else:
        if not torch.equal(gathered, a_torch.contiguous()):
            raise AssertionError("gathered a differs from torch's all_gather")
        _close(y, y_torch.float(), dtype, exact, "result vs torch fused_all_gather_matmul fallback")
    if alg != "auto" and rep["algorithm"] != alg.replace("sliced:2", "sliced"):
        raise AssertionError(f"report says {rep['algorithm']}, asked for {alg}")


def rs_case(rank, n, alg, dtype, dim, exact, group=None, reduce_op="sum"):
    """matmul_reduce_scatter vs the reference and vs torch's reduce_scatter."""
    dim = dim % 3
    shape = [2 * n if dim == 0 else 2, 4 * n if dim == 1 else 5, 16]  # divisible: torch's fallback needs it
    ncols = 4 * n if dim == 2 else 12
    B = _data([16, ncols], dtype, 7, exact)
    As = [_data(shape, dtype, 100 + r, exact) for r in range(n)]
    z = cf.matmul_reduce_scatter(As[rank], B, scatter_dim=dim, reduce_op=reduce_op, algorithm=alg, group=group,
                                 timeout=30)
    total = sum(torch.matmul(a.float(), B.float()) for a in As)
    if reduce_op == "avg":
        total = total / n
    _close(z, total.tensor_split(n, dim=dim)[rank], dtype, exact, "result vs reference")
    from torch.distributed._symmetric_memory import _fused_matmul_reduce_scatter_fallback

    z_torch = _fused_matmul_reduce_scatter_fallback(As[rank], B, reduce_op, dim, _group_name(group))
    _close(z, z_torch.float(), dtype, exact, "result vs torch reduce_scatter(a @ b)")


def consume_case(rank, n, alg, dtype, exact):
    """all_gather_consume: every shard arrives once, bit-exact; compared with torch's all_gather."""
    shards = [_data([6, 4], dtype, 20 + r, exact) for r in range(n)]
    seen = []
    results = cf.all_gather_consume(shards[rank], lambda t, s: (seen.append(s), t.clone())[1], algorithm=alg,
                                    timeout=30)
    if sorted(seen) != list(range(n)):
        raise AssertionError(f"consumer saw sources {seen}")
    if alg in ("ring", "ring:2") and seen[0] != rank:
        raise AssertionError(f"the local shard must come first, saw {seen}")
    torch_out = [torch.empty_like(shards[0]) for _ in range(n)]
    dist.all_gather(torch_out, shards[rank])
    for s in range(n):
        if not torch.equal(results[s], shards[s]) or not torch.equal(results[s], torch_out[s]):
            raise AssertionError(f"shard of rank {s} differs")


def produce_case(rank, n, alg, dtype, exact):
    """produce_reduce_scatter: producer called once per destination, own shard last on the ring."""
    calls = []

    def partial(r, d):
        return _data([6, 4], dtype, 1000 * r + d, exact)

    def producer(d):
        calls.append(d)
        return partial(rank, d)

    out = cf.produce_reduce_scatter(producer, algorithm=alg, timeout=30)
    if sorted(calls) != list(range(n)):
        raise AssertionError(f"producer called for {calls}")
    if alg.startswith("ring") or alg == "bidirectional":
        if calls[-1] != rank and alg != "bidirectional":
            raise AssertionError(f"own shard must be produced last on the ring, order {calls}")
    ref = sum(partial(r, rank).float() for r in range(n))
    _close(out, ref, dtype, exact, "result vs reference")
    torch_out = torch.empty(6, 4, dtype=dtype)
    dist.reduce_scatter(torch_out, [partial(rank, d) for d in range(n)])
    _close(out, torch_out.float(), dtype, exact, "result vs torch reduce_scatter")


def a2a_case(rank, n, alg, dtype, exact):
    """all_to_all_consume: chunk from every source once, bit-exact; compared with torch's all_to_all."""
    if alg == "bidirectional":
        return
    chunks = [_data([3, 8], dtype, 100 * rank + d, exact) for d in range(n)]
    seen = []
    results = cf.all_to_all_consume(chunks, lambda t, s: (seen.append(s), t.clone())[1], dim=1, algorithm=alg,
                                    timeout=30)
    if sorted(seen) != list(range(n)):
        raise AssertionError(f"consumer saw sources {seen}")
    torch_out = [torch.empty_like(chunks[0]) for _ in range(n)]
    torch_all_to_all(torch_out, chunks)
    for s in range(n):
        want = _data([3, 8], dtype, 100 * s + rank, exact)
        if not torch.equal(results[s], want) or not torch.equal(results[s], torch_out[s]):
            raise AssertionError(f"chunk from rank {s} differs")


def matrix(rank, n):
    """Every op x algorithm x dtype x dim on the default group."""
    results = {}
    for alg in ALGORITHMS:
        for dname, dtype in DTYPES.items():
            for exact in (False, True):
                tier = "exact" if exact else "tol"
                for dim in (0, 1, -1):
                    _run(results, f"ag-{alg}-{dname}-{tier}-dim{dim}",
                         lambda: ag_case(rank, n, alg, dtype, dim, exact))
                    _run(results, f"rs-{alg}-{dname}-{tier}-dim{dim}",
                         lambda: rs_case(rank, n, alg, dtype, dim, exact))
                _run(results, f"consume-{alg}-{dname}-{tier}", lambda: consume_case(rank, n, alg, dtype, exact))
                _run(results, f"produce-{alg}-{dname}-{tier}", lambda: produce_case(rank, n, alg, dtype, exact))
                _run(results, f"a2a-{alg}-{dname}-{tier}", lambda: a2a_case(rank, n, alg, dtype, exact))
    _run(results, "rs-avg", lambda: rs_case(rank, n, "ring", torch.float32, 0, False, reduce_op="avg"))
    return results


def half_contraction(rank, n):
    """all_gather_matmul along the contraction dim in float16 and bfloat16, partial products that a sum in the
    input's type rounds away or overflows (float16: 40000 + 30000 is inf though the whole sum is 40000;
    bfloat16: 256 + 1 is 256): every algorithm's result is the unsharded float32 product rounded once, as
    torch's own matmul gives it. Needs 3 ranks or more (two partials of a finite sum cannot overflow)."""
    results = {}
    for dname, dtype, partials in (("fp16", torch.float16, [40000.0, 30000.0, -30000.0]),
                                   ("bf16", torch.bfloat16, [256.0, 1.0, -256.0])):
        x = torch.tensor([partials + [0.0] * (n - 3)])  # (1, n): rank r holds column r
        y = torch.ones(n, 2)
        want = (x @ y).to(dtype)
        whole = x.to(dtype) @ y.to(dtype)

        for alg in ("ring", "bidirectional", "sliced:2", "vanilla", "auto"):
            def case(alg=alg):
                if not torch.equal(whole, want):  # torch's own half matmul: the sum in float32, rounded once
                    raise AssertionError(f"torch's unsharded {dname} matmul gives {whole.tolist()}, not {want.tolist()}")
                got = cf.all_gather_matmul(x[:, rank:rank + 1].to(dtype), y.to(dtype), gather_dim=-1, algorithm=alg,
                                           timeout=30)
                if got.dtype != dtype or not torch.equal(got, want):
                    raise AssertionError(f"{alg}: {got.tolist()} ({got.dtype}), want {want.tolist()}")

            _run(results, f"{dname}-{alg}", case)
    return results


HALF_SCATTER_ALGORITHMS = ("ring", "ring:2", "bidirectional", "sliced:2", "vanilla", "auto")
#: Per dtype, the partials of one output element on ranks 0, 1, 2 (zeros on more ranks) whose running sum in
#: the dtype goes wrong in some ring order: float16's 40000 + 30000 is inf, bfloat16's 256 + 1 is 256.
HALF_PARTIALS = {"fp16": (torch.float16, (40000.0, 30000.0, -30000.0)),
                 "bf16": (torch.bfloat16, (256.0, 1.0, -256.0))}


def half_scatter(rank, n):
    """The reduce-scatter sums in float16 and bfloat16 against the unsharded float32 sum rounded once: the
    forward of matmul_reduce_scatter and produce_reduce_scatter, the weight gradient of matmul_reduce_scatter,
    the dgrad and wgrad of all_gather_matmul and the input gradient of produce_reduce_scatter, every algorithm.
    Also ShardedLinear's input gradient, Ulysses attention's dV and the MoE combine's expert weight gradient
    (sums of a piece per arriving chunk).
    Each case runs n times with the partials moved one rank on (``turn``), so every output shard's ring order
    starts at every rank; the sums in the input's type (the code before) overflow or lose the 1 in some of
    them. Needs 3 ranks or more."""
    results = {}
    rows, cols = 2, 3
    for dname, (dtype, values) in HALF_PARTIALS.items():
        values = list(values) + [0.0] * (n - 3)
        want = torch.tensor(sum(values)).to(dtype)  # the float32 sum, rounded once
        for alg in HALF_SCATTER_ALGORITHMS:
            def check(wrong, what, got, shape, alg=alg, want=want, dtype=dtype):
                """A wrong sum goes into ``wrong``, said once the case's calls are all made (ranks stay in step)."""
                if got.dtype != dtype or list(got.shape) != list(shape) or not torch.equal(
                        got, torch.full(shape, want.item(), dtype=dtype)):
                    wrong.append(f"{what} ({alg}): {got.tolist()} ({got.dtype}), want {want.item()} in "
                                 f"{list(shape)}")

            def forward(alg=alg, values=values, dtype=dtype):
                wrong: list = []
                for turn in range(n):
                    mine = values[(rank + turn) % n]
                    # matmul_reduce_scatter: every element of this rank's partial a @ b is `mine`
                    a = torch.full((n * rows, 1), mine, dtype=dtype)
                    b = torch.ones(1, cols, dtype=dtype)
                    whole = torch.cat([torch.full((n * rows, 1), values[(r + turn) % n]) for r in range(n)], 1)
                    unsharded = whole.to(dtype) @ torch.ones(n, cols, dtype=dtype)
                    if not torch.isfinite(unsharded).all():  # only cases whose unsharded op is finite
                        raise AssertionError(f"torch's unsharded matmul is {unsharded.tolist()}")
                    check(wrong, f"matmul_reduce_scatter turn {turn}",
                          cf.matmul_reduce_scatter(a, b, algorithm=alg, timeout=30), (rows, cols))
                    check(wrong, f"produce_reduce_scatter turn {turn}",
                          cf.produce_reduce_scatter(lambda d: torch.full((rows, cols), mine, dtype=dtype),
                                                    algorithm=alg, timeout=30), (rows, cols))
                if wrong:
                    raise AssertionError("; ".join(wrong))

            def backward(alg=alg, values=values, dtype=dtype):
                wrong: list = []
                for turn in range(n):
                    mine = values[(rank + turn) % n]
                    # matmul_reduce_scatter's wgrad db = a^T @ AG(dz), a GEMM per arriving slice of dz: dz this
                    # rank's `mine`, a 1 on each shard's first row and 0 elsewhere, so every GEMM's product is
                    # exact (a step may join slices of two shards) and the steps add one `mine` per rank
                    a = (torch.arange(n * rows) % rows == 0).to(dtype)[:, None]
                    b = torch.ones(1, cols, dtype=dtype, requires_grad=True)
                    z = cf.matmul_reduce_scatter(a, b, algorithm=alg, timeout=30)
                    z.backward(torch.full_like(z, mine))
                    check(wrong, f"matmul_reduce_scatter wgrad turn {turn}", b.grad, (1, cols))
                    # all_gather_matmul's wgrad db = AG(x)^T @ dy, a GEMM per arriving shard of x: x this rank's
                    # `mine`, dy 1 on each shard's first row; its dgrad dx = RS(dy @ b^T): dy this rank's `mine`
                    x = torch.full((rows, 1), mine, dtype=dtype)
                    b = torch.ones(1, cols, dtype=dtype, requires_grad=True)
                    y = cf.all_gather_matmul(x, b, algorithm=alg, timeout=30)
                    y.backward((torch.arange(n * rows) % rows == 0).to(dtype)[:, None].expand_as(y).contiguous())
                    check(wrong, f"all_gather_matmul wgrad turn {turn}", b.grad, (1, cols))
                    x = torch.ones(rows, 1, dtype=dtype, requires_grad=True)
                    y = cf.all_gather_matmul(x, torch.ones(1, 1, dtype=dtype), algorithm=alg, timeout=30)
                    y.backward(torch.full_like(y, mine))
                    check(wrong, f"all_gather_matmul dgrad turn {turn}", x.grad, (rows, 1))
                    # produce_reduce_scatter's input gradient: every destination's partial is the input, so
                    # its gradient sums the output gradients of every rank (arriving one per step)
                    x = torch.zeros(rows, cols, dtype=dtype, requires_grad=True)
                    out = cf.produce_reduce_scatter(lambda d, x: x * 1, inputs=(x,), algorithm=alg, timeout=30)
                    out.backward(torch.full_like(out, mine))
                    check(wrong, f"produce_reduce_scatter input gradient turn {turn}", x.grad, (rows, cols))
                if wrong:
                    raise AssertionError("; ".join(wrong))

            def sharded(alg=alg, values=values, dtype=dtype):
                # ShardedLinear's input gradient dx = sum_s dy[..., cols_s] @ W_s, one weight shard per ring
                # step: W_s (1, 1) holds rank s's `mine`, dy all ones
                from commfuse.nn import ShardedLinear

                wrong: list = []
                for turn in range(n):
                    layer = ShardedLinear(1, n, bias=False, algorithm=alg, dtype=dtype)
                    with torch.no_grad():
                        layer.weight.to_local().fill_(values[(rank + turn) % n])
                    x = torch.ones(rows, 1, dtype=dtype, requires_grad=True)
                    layer(x).backward(torch.ones(rows, n, dtype=dtype))
                    check(wrong, f"ShardedLinear dgrad turn {turn}", x.grad, (rows, 1))
                if wrong:
                    raise AssertionError("; ".join(wrong))

            def ulysses(alg=alg, values=values, dtype=dtype):
                # Ulysses attention's dV sums one piece per arriving output-gradient chunk (the query rows of
                # one rank): every query attends only to rank 0's key (scores +-100 a side: softmax gives 1
                # and 0), so rank 0's dV is the sum of every rank's dO, here this rank's `mine`
                from commfuse.nn.attention import ulysses_attention

                wrong: list = []
                for turn in range(n):
                    q = torch.ones(1, 1, n, 1, dtype=dtype)
                    k = torch.full((1, 1, n, 1), 100.0 if rank == 0 else -100.0, dtype=dtype)
                    v = torch.zeros(1, 1, n, 1, dtype=dtype, requires_grad=True)
                    o = ulysses_attention(q, k, v, causal=False, algorithm=alg, timeout=30)
                    o.backward(torch.full_like(o, values[(rank + turn) % n]))
                    if rank == 0:
                        check(wrong, f"ulysses dV turn {turn}", v.grad, (1, 1, n, 1))
                    elif v.grad.abs().max() != 0:
                        wrong.append(f"ulysses dV turn {turn} ({alg}): {v.grad.flatten().tolist()}, want zeros")
                if wrong:
                    raise AssertionError("; ".join(wrong))

            def moe(alg=alg, values=values, dtype=dtype):
                # experts_combine's expert weight gradient dw2 = (1/n) sum over sources q of act_q^T @ dy_q, one
                # source a step: one expert a rank, one row from every rank to every rank, acts all ones, dy
                # this rank's `mine`; so rank e's dw2 is the mean of the ranks' `mine` (the scale is added
                # with each product, so float16 cannot overflow here: bfloat16 256 / 3 + 1 / 3 - 256 / 3 can
                # lose the third)
                from commfuse.nn.moe import experts_combine

                wrong: list = []
                mean = torch.tensor(sum(values) / n).to(dtype)
                counts = torch.ones(n, 1, dtype=torch.int64)
                for turn in range(n):
                    w2 = torch.ones(1, 1, 1, dtype=dtype, requires_grad=True)
                    ys = experts_combine(torch.ones(n, 1, dtype=dtype), w2, counts, counts, algorithm=alg)
                    ys.backward(torch.full_like(ys, values[(rank + turn) % n]))
                    if not torch.equal(w2.grad, torch.full_like(w2, mean.item())):
                        wrong.append(f"experts_combine dw2 turn {turn} ({alg}): {w2.grad.flatten().tolist()}, "
                                     f"want {mean.item()}")
                if wrong:
                    raise AssertionError("; ".join(wrong))

            _run(results, f"{dname}-{alg}-forward", forward)
            _run(results, f"{dname}-{alg}-backward", backward)
            _run(results, f"{dname}-{alg}-sharded", sharded)
            if alg != "bidirectional":  # the all-to-all has no bidirectional ring
                _run(results, f"{dname}-{alg}-ulysses", ulysses)
                _run(results, f"{dname}-{alg}-moe", moe)
    return results


# -- edge cases -------------------------------------------------------------


def edges(rank, n):
    results = {}

    def empty():
        for alg in ("ring", "vanilla", "bidirectional"):
            y = cf.all_gather_matmul(torch.empty(0, 16), torch.randn(16, 4), algorithm=alg, timeout=30)
            assert y.shape == (0, 4), y.shape
            z = cf.matmul_reduce_scatter(torch.empty(0, 16), torch.randn(16, 4), algorithm=alg, timeout=30)
            assert z.shape == (0, 4), z.shape
            k0 = cf.all_gather_matmul(torch.empty(3, 0), torch.empty(0, 4), algorithm=alg, timeout=30)
            assert k0.shape == (3 * n, 4) and not k0.any()

    def noncontiguous():
        A = torch.randn(16, 4 * n, generator=_gen(5)).t()  # (4n, 16), transposed view
        B = torch.randn(5, 16, generator=_gen(6)).t()  # (16, 5), transposed view
        shard = A.tensor_split(n)[rank]
        assert not shard.is_contiguous() and not B.is_contiguous()
        for alg in ("ring", "bidirectional", "sliced", "vanilla"):
            _close(cf.all_gather_matmul(shard, B, algorithm=alg, timeout=30), A @ B, torch.float32, False, alg)
            z = cf.matmul_reduce_scatter(A, B, algorithm=alg, scatter_dim=1, timeout=30)
            _close(z, (n * (A @ B)).tensor_split(n, dim=1)[rank], torch.float32, False, alg)

    def uneven():
        rows = 3 * n + 1  # does not divide: tensor_split gives rank 0 one more row
        A = torch.randn(rows, 8, generator=_gen(8))
        B = torch.randn(8, 3, generator=_gen(9))
        shard = A.tensor_split(n)[rank]
        for alg in ("ring", "ring:2", "bidirectional"):
            y = cf.all_gather_matmul(shard, B, gathered_size=rows, algorithm=alg, timeout=30)
            _close(y, A @ B, torch.float32, False, f"ag {alg}")
            z = cf.matmul_reduce_scatter(A, B, algorithm=alg, timeout=30)
            _close(z, (n * (A @ B)).tensor_split(n)[rank], torch.float32, False, f"rs {alg}")
        for alg in ("vanilla", "sliced:3"):
            z = cf.matmul_reduce_scatter(A, B, algorithm=alg, timeout=30)
            _close(z, (n * (A @ B)).tensor_split(n)[rank], torch.float32, False, f"rs {alg}")
        try:
            cf.all_gather_matmul(shard, B, gathered_size=rows + n, timeout=30)
        except CommfuseError as e:
            assert "gather_dim 0" in str(e) and f"world size {n}" in str(e), e
        else:
            if (rows + n) // n + (1 if rank < (rows + n) % n else 0) != shard.shape[0]:
                raise AssertionError("a wrong gathered_size was accepted")

    def profiler_spans():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            cf.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 4), algorithm="ring", timeout=30)
        names = {e.name for e in prof.events()}
        for i in range(n):
            assert f"commfuse.all_gather_matmul.ring.step{i}" in names, sorted(names)[:20]

    def wrong_chunk_count():
        try:
            cf.all_to_all_consume([torch.zeros(2)] * (n + 1), lambda t, s: None, timeout=30)
        except CommfuseError as e:
            assert f"{n + 1} tensors but the world size is {n}" in str(e), e
        else:
            raise AssertionError("wrong number of chunks accepted")

    def subgroups():
        members = list(range(1, n))  # every rank but 0: an odd group when n is 4
        group = dist.new_group(members)
        pair = dist.new_group([0, n - 1])
        if rank in members:
            g_rank, g_n = members.index(rank), len(members)
            for alg in ("ring", "bidirectional", "vanilla"):
                ag_case(g_rank, g_n, alg, torch.float32, 1, False, group=group)
                rs_case(g_rank, g_n, alg, torch.float32, 0, False, group=group)
        if rank in (0, n - 1):
            ag_case(0 if rank == 0 else 1, 2, "ring", torch.float32, 0, True, group=pair)
        dist.barrier()

    for name, fn in [("empty", empty), ("noncontiguous", noncontiguous), ("uneven", uneven),
                     ("profiler_spans", profiler_spans), ("wrong_chunk_count", wrong_chunk_count),
                     ("subgroups", subgroups)]:
        _run(results, name, fn)
    return results


def world_one(rank, n):
    """A real process group of one rank: every op is the local computation."""
    A, B = torch.randn(4, 8), torch.randn(8, 3)
    rep = {}
    assert torch.equal(cf.all_gather_matmul(A, B, report=rep), A @ B) and rep["algorithm"] == "vanilla"
    assert torch.equal(cf.matmul_reduce_scatter(A, B), A @ B)
    assert cf.all_gather_consume(A, lambda t, s: (s, t.sum().item())) == [(0, A.sum().item())]
    assert torch.equal(cf.produce_reduce_scatter(lambda d: A + d), A)
    assert cf.all_to_all_consume([A], lambda t, s: s) == [0]
    return "ok"


def mismatch(rank, n, kind):
    """Ranks disagree; every rank must end in a CommfuseError within the timeout. Returns (type, message, seconds)."""
    t0 = time.monotonic()
    try:
        if kind == "shape":
            rows = 8 if rank == 0 else 4
            cf.all_gather_matmul(torch.randn(rows, 16), torch.randn(16, 4), algorithm="ring", timeout=4)
        elif kind == "algorithm":
            cf.matmul_reduce_scatter(torch.randn(8, 16), torch.randn(16, 4),
                                     algorithm="ring" if rank == 0 else "vanilla", timeout=4)
        elif kind == "absent":  # rank 1 never calls; the others wait, with the check off, in step 0
            if rank != 1:
                cf.all_gather_matmul(torch.randn(4, 16), torch.randn(16, 4), algorithm="ring", timeout=3,
                                     check=False)
            else:
                time.sleep(8)
                return ("absent", "", time.monotonic() - t0)
    except CommfuseError as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("no error", "", time.monotonic() - t0)


__all__ = ["CommfuseTimeoutError", "MismatchError", "edges", "matrix", "mismatch", "world_one"]


def repeated_without_program(rank, n):
    """Calls of one signature, again and again with new values: after the first (planned and checked
    through the program), vanilla calls take ``execute_into`` and rings ``execute_one_by_one`` (called by
    the gather and scatter runners, whose gather walk the all-gather matmul's one-weight ring in
    ``commfuse.fused.all_gather_matmul`` takes too), and stay right. Returns per op and algorithm: [calls without
    a program, every result right]."""
    import commfuse.planning.gather as gather
    import commfuse.planning.scatter as scatter

    walked = []
    runners = callers = (gather, scatter)
    real_into, real_one = gather.execute_into, gather.execute_one_by_one

    def into(plan, *args):
        walked.append(plan.label)
        return real_into(plan, *args)

    def one_by_one(plan, *args):
        walked.append(plan.label)
        return real_one(plan, *args)

    for module in runners:
        module.execute_into = into
    for module in callers:
        module.execute_one_by_one = one_by_one
    out = {}
    try:
        for op, alg, dim in (("all_gather_matmul", "vanilla", 0), ("matmul_reduce_scatter", "vanilla", 0),
                             ("all_gather_matmul", "ring", 0), ("all_gather_matmul", "ring:2", 0),
                             ("matmul_reduce_scatter", "ring", 0), ("matmul_reduce_scatter", "ring:2", 0),
                             ("matmul_reduce_scatter", "ring", 1)):
            right = True
            before = len(walked)
            for call in range(5):
                every = [_data((6, 5), torch.float32, 100 * call + r, True) for r in range(n)]
                w = _data((5, 3 * n), torch.float32, 999 + call, True)
                if op == "all_gather_matmul":
                    got = cf.all_gather_matmul(every[rank], w, algorithm=alg)
                    want = torch.cat(every) @ w
                else:
                    fulls = [_data((6 * n, 5), torch.float32, 50 + 7 * call + r, True) for r in range(n)]
                    got = cf.matmul_reduce_scatter(fulls[rank], w, algorithm=alg, scatter_dim=dim)
                    want = sum(f @ w for f in fulls).tensor_split(n, dim=dim)[rank]
                right = right and torch.equal(got, want)
            out[f"{op} {alg} dim {dim}"] = [len(walked) - before, right]
    finally:
        for module in runners:
            module.execute_into = real_into
        for module in callers:
            module.execute_one_by_one = real_one
    return out
