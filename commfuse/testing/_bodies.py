"""Rank-side bodies of the conformance suite, one per tier.

Each runs many cases in one process group and returns
``{case: {"error": None | text, "figures": {...}}}``; the pytest side
(``suite``) turns every case into its own test. ``backend_ref`` is a
registered backend name or ``module:factory``.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist

from commfuse.schedule import parse_algorithm

EXACT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


def backend_from(ref: str, group=None, device=None):
    """The backend under test: a registered name, or ``module:factory`` called as factory(group=, device=)."""
    if ":" in ref:
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)(group=group, device=device)
    from commfuse import backends

    return backends.get(ref, group=group, device=device)


def rank_device(device: str, rank: int) -> str:
    """This rank's device: ``cpu`` as is; for an accelerator type, device ``rank % count`` (and make it current)."""
    if device == "cpu" or ":" in device:
        return device
    count = torch.accelerator.device_count() if hasattr(torch, "accelerator") else 0
    if count < 1:
        return device
    index = rank % count
    torch.accelerator.set_device_index(index)
    return f"{device}:{index}"


def _case(results: dict, name: str, fn) -> None:
    figures: dict = {}
    try:
        out = fn()
        if isinstance(out, dict):
            figures.update(out)
        results[name] = {"error": None, "figures": figures}
        if "skip" in figures:  # a capability the case found on the backend object itself
            results[name]["skip"] = figures.pop("skip")
    except Exception as e:  # reported per case
        results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}", "figures": figures}


def _values(shape, dtype, seed: int, exact: bool, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-1, 2, shape, generator=g).float() if exact else torch.randn(shape, generator=g)
    return t.to(dtype=dtype, device=device)


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    got, want = got.detach().cpu(), want.detach().cpu().to(got.dtype)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
    if exact:
        if not torch.equal(got, want):
            raise AssertionError(f"{what}: not bit-exact (max diff {(got.double() - want.double()).abs().max():.3g})")
        return
    tol = 1e-4 if got.dtype in (torch.float32, torch.float64) else 4e-2
    scale = max(want.double().abs().max().item(), 1.0) if want.numel() else 1.0
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if diff > tol * scale:
        raise AssertionError(f"{what}: max diff {diff:.3g} above {tol:g} x {scale:.3g}")


# -- transport ----------------------------------------------------------------


def transport(rank: int, n: int, ref: str, caps: dict) -> dict:
    from commfuse.schedule import Ring, SliceId, Transfer

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    ring, timeout = Ring(n), caps["timeout_s"]
    results: dict = {}

    def payload(src: int, tag: int) -> torch.Tensor:
        return torch.arange(6, dtype=torch.float32, device=dev) + 1000 * src + 10 * tag

    def exchange(pairs):  # pairs: (shift, channel); send to r+shift, receive from r-shift
        sends = [(Transfer(SliceId(rank), ring.hop(rank, s), s, c), payload(rank, c)) for s, c in pairs]
        bufs = [torch.empty(6, device=dev) for _ in pairs]
        recvs = [(Transfer(SliceId(ring.hop(rank, -s)), ring.hop(rank, -s), s, c), b) for (s, c), b in zip(pairs, bufs)]
        got = be.post(sends, recvs).wait(timeout)
        for (s, c), t in zip(pairs, got):
            src = ring.hop(rank, -s)
            if not torch.equal(t.cpu(), payload(src, c).cpu()):
                raise AssertionError(f"rank {rank} received {t.tolist()} from rank {src} on channel {c}, "
                                     f"expected {payload(src, c).tolist()}")

    _case(results, "ring-shift-forward", lambda: exchange([(1, 0)]))
    _case(results, "ring-shift-backward", lambda: exchange([(n - 1, 0)]))
    _case(results, "ring-shift-both-directions", lambda: exchange([(1, 0), (n - 1, 1)]))
    for k in range(1, n):
        _case(results, f"pairwise-distance-{k}", lambda k=k: exchange([(k, 0)]))

    def large():
        big = torch.arange(2 * 1024 * 1024, dtype=torch.float32, device=dev) + rank
        buf = torch.empty_like(big)
        nxt, prv = ring.next(rank), ring.prev(rank)
        (got,) = be.post([(Transfer(SliceId(rank), nxt, 1, 0), big)],
                         [(Transfer(SliceId(prv), prv, 1, 0), buf)]).wait(timeout)
        if not torch.equal(got.cpu(), (torch.arange(2 * 1024 * 1024, dtype=torch.float32) + prv)):
            raise AssertionError("an 8 MiB message arrived corrupted")

    _case(results, "large-message", large)

    def self_exchange():
        # the block a rank keeps for itself in an all-to-all never travels, arrives first and unchanged
        import commfuse as cf

        chunks = [torch.full((3,), float(100 * rank + d), device=dev) for d in range(n)]
        seen = []
        out = cf.all_to_all_consume(chunks, lambda t, s: (seen.append(s), t.clone())[1], algorithm="ring",
                                    backend=be, timeout=timeout)
        if seen[0] != rank or not torch.equal(out[rank], chunks[rank]):
            raise AssertionError(f"own block: first consumer call was source {seen[0]}")
        if caps["self_transfer"]:
            t = payload(rank, 7)
            buf = torch.empty_like(t)
            (got,) = be.post([(Transfer(SliceId(rank), rank, 0, 7), t)], [(Transfer(SliceId(rank), rank, 0, 7), buf)]).wait(timeout)
            if not torch.equal(got, t):
                raise AssertionError("a message to self arrived changed")

    _case(results, "self-exchange", self_exchange)
    return results


# -- schedules: every collective x algorithm x dtype, exact and tolerance tiers ----------------------


def schedules(rank: int, n: int, ref: str, caps: dict) -> dict:
    import commfuse as cf

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    timeout = caps["timeout_s"]
    results: dict = {}
    for alg in caps["algorithms"]:
        for dname in caps["dtypes"]:
            dtype = EXACT_DTYPES[dname]
            for exact in (True, False):
                tier = "exact" if exact else "tolerance"

                def ag(alg=alg, dtype=dtype, exact=exact):
                    shards = [_values((5, 4), dtype, 10 + r, exact, dev) for r in range(n)]
                    got = cf.all_gather_consume(shards[rank], lambda t, s: t.clone(), algorithm=alg, backend=be,
                                                timeout=timeout)
                    for s in range(n):  # moving data never changes it: bit-exact in every tier
                        _same(got[s], shards[s], True, f"shard of rank {s}")

                def rs(alg=alg, dtype=dtype, exact=exact):
                    def partial(r, d):
                        return _values((5, 4), dtype, 100 * r + d, exact, dev)

                    got = cf.produce_reduce_scatter(lambda d: partial(rank, d), algorithm=alg, backend=be,
                                                    timeout=timeout)
                    want = sum(partial(r, rank).double() for r in range(n))
                    _same(got, want, exact, "reduced shard")

                def a2a(alg=alg, dtype=dtype, exact=exact):
                    blocks = [_values((3, 4), dtype, 1000 * rank + d, exact, dev) for d in range(n)]
                    got = cf.all_to_all_consume(blocks, lambda t, s: t.clone(), algorithm=alg, backend=be,
                                                timeout=timeout)
                    for s in range(n):
                        _same(got[s], _values((3, 4), dtype, 1000 * s + rank, exact, dev), True, f"block from {s}")

                def pa2a(alg=alg, dtype=dtype, exact=exact):
                    made = []

                    def producer(d):
                        made.append(d)
                        return _values((3, 4), dtype, 2000 * rank + d, exact, dev)

                    got = cf.produce_all_to_all(producer, algorithm=alg, backend=be, timeout=timeout)
                    _made_once(made, n)
                    for s in range(n):
                        _same(got[s], _values((3, 4), dtype, 2000 * s + rank, exact, dev), True, f"block from {s}")

                _case(results, f"all_gather-{alg}-{dname}-{tier}", ag)
                _case(results, f"reduce_scatter-{alg}-{dname}-{tier}", rs)
                if alg in a2a_algorithms(caps["algorithms"]):
                    _case(results, f"all_to_all-{alg}-{dname}-{tier}", a2a)
                    _case(results, f"produce_all_to_all-{alg}-{dname}-{tier}", pa2a)
            if alg in a2a_algorithms(caps["algorithms"]):
                # the same schedules over blocks of different sizes, empty ones among them (the own block too),
                # the sizes exchanged first
                _case(results, f"all_to_all-uneven-{alg}-{dname}",
                      lambda alg=alg, dtype=dtype: _uneven_consume(rank, n, be, alg, dtype, dev, timeout, "mixed",
                                                                   "exchanged", dim=0))
                _case(results, f"produce_all_to_all-uneven-{alg}-{dname}",
                      lambda alg=alg, dtype=dtype: _uneven_produce(rank, n, be, alg, dtype, dev, timeout, "mixed",
                                                                   "input-splits", dim=0))
    return results


# -- all-to-all over per-peer sizes: uneven and empty blocks ---------------------------------------------------

#: Who sends whom how many rows in the uneven all-to-all cases (:func:`a2a_rows`): sizes that differ with
#: empty blocks among them (the own block of some ranks too), a rank that receives nothing, a rank that
#: sends nothing, nothing at all, and one rank (0) whose blocks both ways all have one size while the
#: others' differ (every rank must still take the same path through the backend).
A2A_PATTERNS = ("mixed", "rank1-receives-nothing", "rank0-sends-nothing", "all-empty", "rank0-balanced")
#: How the uneven ``all_to_all_consume`` cases learn the sizes: ``output_splits`` given, or exchanged.
CONSUME_SPLITS = ("given", "exchanged")
#: How the uneven ``produce_all_to_all`` cases learn them: ``input_splits`` only (the sizes exchanged),
#: ``output_splits`` only (the producer's blocks say what is sent), or both.
PRODUCE_SPLITS = ("input-splits", "output-splits", "both-splits")
#: The algorithms whose messages the executor posts one by one, so that an empty block's absence shows.
POSTING_ALGORITHMS = ("ring", "ring:2")


def a2a_algorithms(algorithms) -> list[str]:
    """The algorithms of ``algorithms`` the all-to-alls have (no bidirectional ring)."""
    return [a for a in algorithms if parse_algorithm(a).name != "bidirectional"]


def uneven_op_cases(algorithms, dtypes) -> list[str]:
    """The ops tier's all-to-all cases: ``all_to_all_consume-{splits}-{pattern}-{algorithm}-{dtype}``,
    ``produce_all_to_all-even-{algorithm}-{dtype}``, ``produce_all_to_all-{splits}-{pattern}-{algorithm}-{dtype}``
    and ``empty-blocks-not-posted-{algorithm}``."""
    out = [f"all_to_all_consume-{m}-{p}-{a}-{d}" for m in CONSUME_SPLITS for p in A2A_PATTERNS for a in algorithms
           for d in dtypes]
    out += [f"produce_all_to_all-even-{a}-{d}" for a in algorithms for d in dtypes]
    out += [f"produce_all_to_all-{m}-{p}-{a}-{d}" for m in PRODUCE_SPLITS for p in A2A_PATTERNS for a in algorithms
            for d in dtypes]
    out += [f"empty-blocks-not-posted-{a}" for a in POSTING_ALGORITHMS]
    return out + [f"first-all_to_all-of-a-group-rank0-balanced-{a}" for a in algorithms]


def a2a_rows(pattern: str, n: int) -> list[list[int]]:
    """``rows[s][d]``: how many rows rank s sends rank d in the uneven all-to-all ``pattern``."""
    def rows(s: int, d: int) -> int:
        if pattern == "mixed":  # 0 to 3 rows: rank 0's own block is empty, from 3 ranks on some others too
            return (s + 2 * d) % 4
        if pattern == "rank1-receives-nothing":
            return 0 if d == 1 else 1 + (s + d) % 3
        if pattern == "rank0-sends-nothing":
            return 0 if s == 0 else 1 + (s + d) % 3
        if pattern == "all-empty":
            return 0
        if pattern == "rank0-balanced":
            return 2 if 0 in (s, d) else (s + 2 * d + 1) % 4
        raise ValueError(f"unknown all-to-all pattern {pattern!r}")

    return [[rows(s, d) for d in range(n)] for s in range(n)]


def _block(src: int, dst: int, rows: int, dtype, dev, dim: int, salt: int) -> torch.Tensor:
    """The block rank ``src`` sends rank ``dst``: ``rows`` rows along ``dim`` (of 1 or 2) of random values."""
    shape = (rows, 3) if dim == 0 else (2, rows, 3)
    return _values(shape, dtype, 100_003 * salt + 1009 * src + dst, False, dev)


def _made_once(made: list, n: int) -> None:
    if sorted(made) != list(range(n)):
        raise AssertionError(f"the producer was called for destinations {made}, not once for each of {n}")


def _uneven_consume(rank, n, be, alg, dtype, dev, timeout, pattern, splits, dim=1, salt=1):
    """``all_to_all_consume`` over the blocks of ``pattern``: every block arrives exactly, the consumer sees each
    source once, an empty tensor of the right shape for an empty block."""
    import commfuse as cf

    rows = a2a_rows(pattern, n)
    chunks = [_block(rank, d, rows[rank][d], dtype, dev, dim, salt) for d in range(n)]
    seen = []

    def consumer(t, s):
        seen.append(s)
        return t.clone()

    kwargs = {"output_splits": [rows[s][rank] for s in range(n)]} if splits == "given" else {"uneven": True}
    got = cf.all_to_all_consume(chunks, consumer, dim=dim, algorithm=alg, backend=be, timeout=timeout, **kwargs)
    if sorted(seen) != list(range(n)):
        raise AssertionError(f"the consumer was called for sources {seen}, not once for each of {n}")
    for s in range(n):
        _same(got[s], _block(s, rank, rows[s][rank], dtype, dev, dim, salt), True,
              f"block from rank {s} ({rows[s][rank]} rows)")


def _uneven_produce(rank, n, be, alg, dtype, dev, timeout, pattern, splits, dim=1, salt=2):
    """``produce_all_to_all`` over the blocks of ``pattern`` (``splits`` says which sizes it is given; ``even``:
    none, every block of 2 rows): every block arrives exactly, each made once."""
    import commfuse as cf

    rows = [[2] * n for _ in range(n)] if splits == "even" else a2a_rows(pattern, n)
    made = []

    def producer(d):
        made.append(d)
        return _block(rank, d, rows[rank][d], dtype, dev, dim, salt)

    kwargs = {}
    if splits in ("input-splits", "both-splits"):
        kwargs["input_splits"] = rows[rank]
    if splits in ("output-splits", "both-splits"):
        kwargs["output_splits"] = [rows[s][rank] for s in range(n)]
    got = cf.produce_all_to_all(producer, dim=dim, algorithm=alg, backend=be, timeout=timeout, **kwargs)
    _made_once(made, n)
    if len(got) != n:
        raise AssertionError(f"{len(got)} blocks came back, expected one from each of {n} ranks")
    for s in range(n):
        _same(got[s], _block(s, rank, rows[s][rank], dtype, dev, dim, salt), True,
              f"block from rank {s} ({rows[s][rank]} rows)")


def _empty_blocks_not_posted(rank, n, be, alg, dev, timeout) -> dict:
    """Uneven all-to-alls, both sides, every pattern, sizes given: what reaches the backend's ``post`` (the call
    check's fingerprints aside) is exactly the non-empty blocks' data, never a message of no elements; where
    every block is empty, nothing at all."""
    from commfuse.runtime.groups import FINGERPRINT_CHANNEL

    own = "post" in getattr(be, "__dict__", {})  # a post set on the object itself is put back as it was
    original = be.post
    seen = {"send": 0, "recv": 0, "messages": 0}
    empty: list[str] = []

    def counting(sends, recvs):
        for side, messages in (("send", sends), ("recv", recvs)):
            for t, x in messages:
                if t.channel == FINGERPRINT_CHANNEL:
                    continue
                seen["messages"] += 1
                seen[side] += x.numel()
                if not x.numel():
                    empty.append(f"a {side} of {t.slice} {'to' if side == 'send' else 'from'} rank {t.peer}")
        return original(sends, recvs)

    try:
        be.post = counting
    except AttributeError:  # __slots__ without __dict__
        return {"skip": "the backend's object takes no attributes; the suite cannot observe its post"}
    figures = {}
    try:
        for pattern in A2A_PATTERNS:
            rows = a2a_rows(pattern, n)
            for side in ("all_to_all_consume", "produce_all_to_all"):
                seen.update(send=0, recv=0, messages=0)
                if side == "all_to_all_consume":
                    _uneven_consume(rank, n, be, alg, torch.float32, dev, timeout, pattern, "given", salt=3)
                else:
                    _uneven_produce(rank, n, be, alg, torch.float32, dev, timeout, pattern, "both-splits", salt=4)
                if empty:
                    raise AssertionError(f"{side}, pattern {pattern}: the backend was asked to post messages of no "
                                         f"elements: {', '.join(empty[:4])}")
                want_send = 6 * sum(rows[rank][d] for d in range(n) if d != rank)  # blocks are (2, rows, 3)
                want_recv = 6 * sum(rows[s][rank] for s in range(n) if s != rank)
                if (seen["send"], seen["recv"]) != (want_send, want_recv):
                    raise AssertionError(f"{side}, pattern {pattern}: the backend posted {seen['send']} elements to "
                                         f"send and {seen['recv']} to receive, expected {want_send} and {want_recv}")
                if pattern == "all-empty" and seen["messages"]:
                    raise AssertionError(f"{side}: an all-to-all of empty blocks posted {seen['messages']} "
                                         "messages, expected none")
                figures[f"{side}.{pattern}.messages"] = seen["messages"]
    finally:
        if own:
            be.post = original
        else:
            del be.post
    return figures


def _first_on_a_fresh_group(rank, n, ref, alg, dev, timeout) -> None:
    """The first all-to-all ever made on a new group is uneven with the sizes given, and rank 0's blocks are even
    both ways while the others' are not: a backend that picks its transport by what one rank's blocks look like
    (or learns on the first call what its group lacks) must still pair every rank's part of it."""
    group = dist.new_group(list(range(n)))
    be = backend_from(ref, group=group, device=dev)
    _uneven_consume(rank, n, be, alg, torch.float32, dev, timeout, "rank0-balanced", "given", salt=5)
    _uneven_produce(rank, n, be, alg, torch.float32, dev, timeout, "rank0-balanced", "both-splits", salt=6)


# -- ops and autograd -----------------------------------------------------------------------------------


def ops(rank: int, n: int, ref: str, caps: dict) -> dict:
    import commfuse as cf

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    timeout = caps["timeout_s"]
    results: dict = {}
    for alg in caps["algorithms"]:
        for dname in caps["dtypes"]:
            dtype = EXACT_DTYPES[dname]
            for exact in (True, False):
                tier = "exact" if exact else "tolerance"

                def agmm(alg=alg, dtype=dtype, exact=exact):
                    a = _values((2, 3 * n, 8), dtype, 1, exact, dev)
                    b = _values((8, 6), dtype, 2, exact, dev)
                    y = cf.all_gather_matmul(a.tensor_split(n, dim=1)[rank], b, gather_dim=1, algorithm=alg,
                                             backend=be, timeout=timeout)
                    _same(y, a.double() @ b.double(), exact, "all_gather_matmul")

                def mmrs(alg=alg, dtype=dtype, exact=exact):
                    b = _values((8, 6), dtype, 3, exact, dev)
                    a = [_values((2, 2 * n, 8), dtype, 20 + r, exact, dev) for r in range(n)]
                    z = cf.matmul_reduce_scatter(a[rank], b, scatter_dim=1, algorithm=alg, backend=be,
                                                 timeout=timeout)
                    want = sum(x.double() @ b.double() for x in a).tensor_split(n, dim=1)[rank]
                    _same(z, want, exact, "matmul_reduce_scatter")

                _case(results, f"all_gather_matmul-{alg}-{dname}-{tier}", agmm)
                _case(results, f"matmul_reduce_scatter-{alg}-{dname}-{tier}", mmrs)
    for alg in a2a_algorithms(caps["algorithms"]):
        for dname in caps["dtypes"]:
            dtype = EXACT_DTYPES[dname]
            for splits in CONSUME_SPLITS:
                for pattern in A2A_PATTERNS:
                    _case(results, f"all_to_all_consume-{splits}-{pattern}-{alg}-{dname}",
                          lambda a=alg, t=dtype, m=splits, p=pattern: _uneven_consume(rank, n, be, a, t, dev, timeout,
                                                                                      p, m))
            _case(results, f"produce_all_to_all-even-{alg}-{dname}",
                  lambda a=alg, t=dtype: _uneven_produce(rank, n, be, a, t, dev, timeout, None, "even"))
            for splits in PRODUCE_SPLITS:
                for pattern in A2A_PATTERNS:
                    _case(results, f"produce_all_to_all-{splits}-{pattern}-{alg}-{dname}",
                          lambda a=alg, t=dtype, m=splits, p=pattern: _uneven_produce(rank, n, be, a, t, dev, timeout,
                                                                                      p, m))
    for alg in POSTING_ALGORITHMS:
        if alg in caps["algorithms"]:
            _case(results, f"empty-blocks-not-posted-{alg}",
                  lambda a=alg: _empty_blocks_not_posted(rank, n, be, a, dev, timeout))
    for alg in a2a_algorithms(caps["algorithms"]):
        _case(results, f"first-all_to_all-of-a-group-rank0-balanced-{alg}",
              lambda a=alg: _first_on_a_fresh_group(rank, n, ref, a, dev, timeout))
    if caps["autograd"]:
        for alg in ("ring", "vanilla"):
            if alg in caps["algorithms"]:
                _case(results, f"autograd-mlp-{alg}", lambda alg=alg: _mlp_grads(rank, n, be, alg, dev))
                _case(results, f"autograd-ops-{alg}", lambda alg=alg: _op_grads(rank, n, be, alg, dev))
    return results


def _mlp_grads(rank, n, be, alg, dev):
    from torch import nn

    from commfuse.nn import ParallelMLP
    from commfuse.nn._common import gather_dim, local

    torch.manual_seed(5)
    fc1, fc2 = nn.Linear(8, 12).to(dev), nn.Linear(12, 8).to(dev)
    ref = nn.Sequential(fc1, nn.GELU(), fc2)
    mlp = ParallelMLP.from_linears(fc1, fc2, algorithm=alg)
    mlp.backend = be
    x = torch.randn(2, 2 * n, 8, device=dev)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).square().sum().backward()
    xs = x.tensor_split(n, dim=1)[rank].clone().requires_grad_()
    mlp(xs).square().sum().backward()
    _same(xs.grad, x_ref.grad.tensor_split(n, dim=1)[rank], False, "input grad")
    _same(gather_dim(mlp.fc1.weight.grad, 0, 12, None), fc1.weight.grad, False, "fc1 weight grad")
    _same(gather_dim(mlp.fc2.weight.grad, 1, 12, None), fc2.weight.grad, False, "fc2 weight grad")
    _same(local(mlp.fc2.bias.grad), fc2.bias.grad, False, "fc2 bias grad")


def _op_grads(rank, n, be, alg, dev):
    import commfuse as cf

    g = torch.Generator().manual_seed(6)
    a = torch.randn(2 * n, 8, generator=g).to(dev)
    b = torch.randn(8, 4, generator=g).to(dev)
    a_ref, b_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
    (a_ref @ b_ref).square().sum().backward()
    shard = a.tensor_split(n)[rank].clone().requires_grad_()
    w = b.clone().requires_grad_()
    y = cf.all_gather_matmul(shard, w, algorithm=alg, backend=be)
    (y.square().sum() / n).backward()  # every rank holds the whole output: count it once
    _same(shard.grad, a_ref.grad.tensor_split(n)[rank], False, "all_gather_matmul input grad")
    wg = w.grad.clone()
    dist.all_reduce(wg)
    _same(wg, b_ref.grad, False, "all_gather_matmul weight grad summed")


# -- determinism and overlap ----------------------------------------------------------------------------


def determinism(rank: int, n: int, ref: str, caps: dict) -> dict:
    import commfuse as cf

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    results: dict = {}
    for alg in caps["algorithms"]:
        def twice(alg=alg):
            a = _values((4 * n, 16), torch.float32, 7 + rank, False, dev)
            b = _values((16, 8), torch.float32, 8, False, dev)
            runs = [(cf.all_gather_matmul(a, b, algorithm=alg, backend=be),
                     cf.matmul_reduce_scatter(a, b, algorithm=alg, backend=be)) for _ in range(2)]
            for x, y in zip(runs[0], runs[1]):
                if not torch.equal(x, y):
                    raise AssertionError("the same inputs gave different outputs")

        _case(results, f"determinism-{alg}", twice)
    return results


def hidden_figures(total: float, compute: float, comm: float) -> dict:
    """The overlap tier's figures from three median times in seconds: the whole op, its compute alone
    (``measure("compute_only")``) and its communication alone (``measure("comm_only")``).

    ``hidden_fraction`` judges the time hidden, ``compute + comm - total``,
    against the most that could be hidden, ``min(compute, comm)``: perfect
    overlap scores 1 whichever side dominates (on a slow link communication
    dwarfs compute, and only the compute's worth of it can ever hide), running
    the two back to back scores 0. Clamped to [0, 1]; 1 when either side
    takes no time (nothing to hide). ``hidden_fraction_of_comm`` is the older
    figure, the time hidden as a fraction of comm-only, kept for reference:
    it cannot exceed compute/comm, so it says little on a slow link.
    """
    from commfuse.schedule import hidden_fraction

    saved = compute + comm - total
    fraction = hidden_fraction(total, compute, comm)
    of_comm = max(0.0, min(1.0, saved / comm)) if comm > 0 else 1.0
    return {"total_ms": 1e3 * total, "compute_only_ms": 1e3 * compute, "comm_only_ms": 1e3 * comm,
            "hidden_ms": 1e3 * saved, "hidden_fraction": fraction, "hidden_fraction_of_comm": of_comm}


def overlap(rank: int, n: int, ref: str, caps: dict) -> dict:
    import commfuse as cf
    from commfuse.runtime import measure

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    results: dict = {}
    # On a device the call returns once its work is queued (a stream-ordered backend never blocks the host),
    # so each sample ends with a host read of work queued after it; and the shapes are bigger, so that the
    # compute (a few ms) stands above the noise of launches and of ranks sharing one device.
    on_device = torch.device(dev).type != "cpu"
    rows, k, cols = (2048, 2048, 4096) if on_device else (512, 512, 1024)
    a = torch.randn(rows, k, device=dev)
    b = torch.randn(k, cols, device=dev)

    def timed(mode):
        samples = []
        for _ in range(7 if on_device else 5):
            dist.barrier()
            t0 = time.perf_counter()
            with measure(mode):
                cf.all_gather_matmul(a, b, algorithm="ring", backend=be)
            if on_device:
                torch.ones(1, device=dev).sum().item()
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[len(samples) // 2]

    def hidden():
        timed(None)  # warm up
        total, comp, comm = timed(None), timed("compute_only"), timed("comm_only")
        figures = dict(hidden_figures(total, comp, comm))
        if figures["hidden_fraction"] < caps["overlap_threshold"]:
            raise AssertionError(f"ring hid {figures['hidden_fraction']:.2f} of the time it could hide (the shorter "
                                 f"of compute-only and comm-only), below the backend's threshold "
                                 f"{caps['overlap_threshold']}: {figures}")
        return figures

    _case(results, "ring-hides-communication", hidden)
    return results


# -- capture: planned calls in a device graph, replayed with new inputs ------------------------------------------

#: The ops, algorithms and ways of the capture tier: its cases are ``{op}-{algorithm}-{way}`` (``graph``: the
#: suite's own torch.cuda.graph; ``helper``: commfuse.graphs.capture), plus :data:`CAPTURE_AUTOGRAD`.
CAPTURE_OPS = ("all_gather_matmul", "matmul_reduce_scatter")
CAPTURE_ALGORITHMS = ("ring", "vanilla")
CAPTURE_WAYS = ("graph", "helper")
#: The capture tier's gradient case: all_gather_matmul's forward and backward through
#: ``commfuse.graphs.capture(backward=True)`` (torch.cuda.make_graphed_callables).
CAPTURE_AUTOGRAD = "autograd-all_gather_matmul-ring-helper"


def capture_cases() -> list[str]:
    return [f"{o}-{a}-{w}" for o in CAPTURE_OPS for a in CAPTURE_ALGORITHMS for w in CAPTURE_WAYS] + [CAPTURE_AUTOGRAD]


def capture_skip_reason(capabilities, name: str) -> str | None:
    """Why the capture tier skips a backend with these plugin capabilities (None: it runs)."""
    if getattr(capabilities, "capturable", False):
        return None
    return (f"capability: backend {name!r} does not declare Capabilities.capturable"
            + (" (its object has no Capabilities record)" if capabilities is None else "")
            + ": the capture tier runs where a backend promises that its planned calls can be captured in a "
              "device graph")


def _graph_api(device_type: str):
    """``(module, Graph class, graph context manager)`` of torch's graph API for ``device_type``: torch.cuda's,
    or torch_npu's mirror of it on ``torch.npu`` (``NPUGraph``); None where torch has none."""
    module = getattr(torch, device_type, None)
    graph_cls = getattr(module, "CUDAGraph", None) or getattr(module, "NPUGraph", None)
    context = getattr(module, "graph", None)
    if graph_cls is None or context is None or not hasattr(module, "Stream"):
        return None
    return module, graph_cls, context


def capture(rank: int, n: int, ref: str, caps: dict) -> dict:
    """Every capture case on this rank: warm up eagerly, capture one call in a device graph, replay it with new
    values copied into the static inputs, and compare with an eager call on the same values and with the
    unsharded reference: bit-exact for all_gather_matmul (integer-valued inputs), within tolerance for
    matmul_reduce_scatter's sums. The ranks agree that each capture succeeded before any replays."""
    import commfuse as cf
    from commfuse.graphs import failed_ranks, paused_watchdog

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    timeout = caps["timeout_s"]
    results: dict = {}
    reason = capture_skip_reason(getattr(be, "capabilities", None), getattr(be, "name", ref))
    if reason:
        return {case: {"error": None, "skip": reason, "figures": {}} for case in capture_cases()}
    device = torch.device(dev)
    api = _graph_api(device.type)
    rows, k, cols = 8, 32, 16

    def inputs(op: str, seed: int):
        if op == "all_gather_matmul":  # integer-valued: every product and sum is exact in float32
            a_full = _values((rows * n, k), torch.float32, seed, True, dev)
            b = _values((k, cols), torch.float32, seed + 1, True, dev)
            return a_full.tensor_split(n)[rank].clone(), b, (a_full.double() @ b.double())
        b = _values((k, cols), torch.float32, seed + 1, False, dev)
        a = [_values((rows * n, k), torch.float32, 100 * seed + r, False, dev) for r in range(n)]
        want = sum(x.double() @ b.double() for x in a).tensor_split(n)[rank]
        return a[rank], b, want

    def run(op: str, alg: str, a, b):
        fn = cf.all_gather_matmul if op == "all_gather_matmul" else cf.matmul_reduce_scatter
        return fn(a, b, algorithm=alg, backend=be, timeout=timeout)

    def agree(ok: bool, what: str) -> None:
        failed = failed_ranks(ok, device, getattr(be, "group", None))
        if failed:
            raise AssertionError(f"rank(s) {failed} failed to {what}; no rank replays")

    def by_graph(op: str, alg: str) -> dict:
        if api is None:
            raise AssertionError(f"the backend declares Capabilities.capturable on {device.type} devices, but "
                                 f"torch.{device.type} has no graph API (graph, CUDAGraph or NPUGraph)")
        module, graph_cls, graph_context = api
        exact = op == "all_gather_matmul"
        a, b, _ = inputs(op, 1)  # the static inputs
        error = None
        try:
            with torch.no_grad():
                side = module.Stream()  # warm-up on a side stream (torch.cuda.graph docs)
                side.wait_stream(module.current_stream())
                with module.stream(side):
                    for _ in range(2):
                        run(op, alg, a, b)
                module.current_stream().wait_stream(side)
                graph = graph_cls()
                with paused_watchdog():
                    try:
                        context = graph_context(graph, capture_error_mode="thread_local")
                    except TypeError:  # a graph API without capture modes
                        context = graph_context(graph)
                    with context:
                        out = run(op, alg, a, b)
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised
            error = e
        agree(error is None, f"capture {op} {alg}")
        if error is not None:
            raise error
        for seed in (2, 3):  # new values in the static inputs, each replay against an eager call on them
            a_new, b_new, want = inputs(op, seed)
            with torch.no_grad():
                a.copy_(a_new)
                b.copy_(b_new)
                graph.replay()
                eager = run(op, alg, a_new, b_new)
            _same(out, eager, exact, f"replay {seed - 1} against an eager call on the same inputs")
            _same(out, want, exact, f"replay {seed - 1} against the unsharded reference")
            _same(eager, want, exact, "the eager call against the unsharded reference")
        return {"replays": 2}

    def by_helper(op: str, alg: str) -> dict:
        if device.type != "cuda":
            return {"skip": f"commfuse.graphs.capture captures CUDA work only; this backend's device is "
                            f"{device.type} (the graph cases capture there with torch.{device.type}'s API)"}
        exact = op == "all_gather_matmul"
        captured = cf.graphs.capture(lambda a, b: run(op, alg, a, b), warmup=2, backend=be)
        for seed in (1, 2, 3):
            a, b, want = inputs(op, seed)
            with torch.no_grad():
                out = captured(a, b)
                eager = run(op, alg, a, b)
            _same(out, eager, exact, f"call {seed} (a replay) against an eager call on the same inputs")
            _same(out, want, exact, f"call {seed} (a replay) against the unsharded reference")
        if captured.signatures != 1:
            raise AssertionError(f"three calls of one signature captured {captured.signatures} graphs, not 1")
        return {"signatures": captured.signatures}

    def by_helper_backward() -> dict:
        if device.type != "cuda":
            return {"skip": f"commfuse.graphs.capture captures CUDA work only; this backend's device is "
                            f"{device.type}"}

        def op(a, b):
            return cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)

        captured = cf.graphs.capture(op, warmup=2, backward=True, backend=be)
        g = torch.Generator().manual_seed(9)
        grad_out = torch.randn(rows * n, cols, generator=g).to(dev)
        for seed in (4, 5):
            a, b, _ = inputs("all_gather_matmul", seed)
            a_g, b_g = a.clone().requires_grad_(), b.clone().requires_grad_()
            (captured(a_g, b_g) * grad_out).sum().backward()
            a_e, b_e = a.clone().requires_grad_(), b.clone().requires_grad_()
            (op(a_e, b_e) * grad_out).sum().backward()
            _same(a_g.grad, a_e.grad, False, f"seed {seed}: input grad, graphed against eager")
            _same(b_g.grad, b_e.grad, False, f"seed {seed}: weight grad, graphed against eager")
        return {"signatures": captured.signatures}

    def case(name: str, fn) -> None:
        _case(results, name, fn)
        entry = results[name]
        skip = entry["figures"].pop("skip", None)
        if skip:
            entry["skip"] = skip

    for op in CAPTURE_OPS:
        for alg in CAPTURE_ALGORITHMS:
            if alg not in caps["algorithms"]:
                continue
            case(f"{op}-{alg}-graph", lambda op=op, alg=alg: by_graph(op, alg))
            case(f"{op}-{alg}-helper", lambda op=op, alg=alg: by_helper(op, alg))
    if caps["autograd"] and "ring" in caps["algorithms"]:
        case(CAPTURE_AUTOGRAD, by_helper_backward)
    return results


# -- robustness: each case in its own launch --------------------------------------------------------------

#: Robustness cases that need more ranks than two, and how many (every one-rank case runs at two).
ROBUSTNESS_MIN_WORLD = {"absent-peer": 2, "mismatch-promptness": 4}
#: The per-call timeout of ``mismatch-promptness``, at least: long enough that a mismatch "found" by a
#: peer's wait running out would fail the case's bound on detection time.
PROMPTNESS_TIMEOUT_S = 60.0
#: ``mismatch-promptness``: every rank must name the mismatch within this many seconds.
PROMPTNESS_BOUND_S = 10.0


def robustness(rank: int, n: int, ref: str, caps: dict, kind: str) -> dict:
    """One robustness case on this rank: a dict the suite judges (``RobustnessTests``).

    ``kind``: the commfuse error type the case ended with (the one-rank
    cases: the type of what their faulty call raised, the injected fault's
    own on rank 1), ``"no error"``, or ``"absent"`` (the rank that stays
    away); ``message`` its text; ``seconds`` from the case's first faulty
    call to the error (the one-rank cases: that call's own duration);
    ``problems``: what this rank saw go wrong itself (a wrong result, an
    unexpected exception), each a sentence; ``figures``: counts worth
    reporting, and how the calls before and after a one-rank fault went.
    """
    from commfuse.errors import CommfuseError

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    out = {"kind": "no error", "message": "", "seconds": 0.0, "problems": [], "figures": {}}
    t0 = time.monotonic()
    try:
        _ROBUSTNESS[kind](rank, n, be, dev, caps, out)
    except CommfuseError as e:
        out["kind"], out["message"] = type(e).__name__, str(e)
    except Exception as e:  # noqa: BLE001 - anything else is a finding, not a crash of the case
        out["kind"], out["message"] = type(e).__name__, str(e)
        out["problems"].append(f"raised {type(e).__name__} (not a commfuse error): {e}\n"
                               f"{traceback.format_exc(limit=6)}")
    since, took = out.pop("_since", t0), out.pop("_took", None)
    out["seconds"] = took if took is not None else time.monotonic() - since
    return out


def _exact_inputs(n: int, dev, seed: int = 31, rows: int = 4, k: int = 16, cols: int = 8):
    """Integer-valued a (gathered) and b, so every result of a ring all_gather_matmul is exact."""
    a = _values((rows * n, k), torch.float32, seed, True, dev)
    b = _values((k, cols), torch.float32, seed + 1, True, dev)
    return a, b, (a.double() @ b.double()).float()


def _mismatched_shapes(rank, n, be, dev, caps, out):
    import commfuse as cf

    rows = 8 if rank == 0 else 4
    cf.all_gather_matmul(torch.randn(rows, 16, device=dev), torch.randn(16, 4, device=dev), algorithm="ring",
                         backend=be, timeout=caps["timeout_s"])


def _mismatched_algorithms(rank, n, be, dev, caps, out):
    import commfuse as cf

    cf.matmul_reduce_scatter(torch.randn(8, 16, device=dev), torch.randn(16, 4, device=dev),
                             algorithm="ring" if rank == 0 else "vanilla", backend=be, timeout=caps["timeout_s"])


def _surface(dev, again) -> None:
    """After a call whose peer is gone: on a stream-ordered backend (NCCL, HCCL) that call returned without
    blocking the host, and its error surfaces asynchronously: a host read of device work queued after it
    waits until the watchdog has aborted the stuck transfers, and the next call raises the error the
    watchdog recorded on the group. On a host-blocking backend (gloo) the call itself raised, and this is
    never reached."""
    try:
        torch.ones(1, device=dev).sum().item()
    except Exception:  # noqa: BLE001 - the device may report the abort here; the next call names it
        pass
    again()


def _absent_peer(rank, n, be, dev, caps, out):
    import commfuse as cf

    timeout = caps["timeout_s"]
    if rank == 1:
        time.sleep(timeout + 3)
        out["kind"] = "absent"
        return

    def call():
        cf.all_gather_matmul(torch.randn(4, 16, device=dev), torch.randn(16, 4, device=dev), algorithm="ring",
                             backend=be, timeout=timeout, check=False)

    call()
    _surface(dev, call)


def _peer_death(rank, n, be, dev, caps, out):
    import commfuse as cf

    calls = []

    def consumer(t, s):
        calls.append(s)
        if rank == 1 and len(calls) == 1:  # mid-schedule: step 0 posted, step 1 never will be
            os.kill(os.getpid(), signal.SIGKILL)
        return None

    def call():
        cf.all_gather_consume(torch.randn(64, 64, device=dev), consumer, algorithm="ring", backend=be,
                              timeout=caps["timeout_s"])

    for _ in range(2):
        call()
    _surface(dev, call)


def _two_threads_one_group(rank, n, be, dev, caps, out):
    """Two threads of every rank on one group: refused (ConcurrentUseError) or right, never wrong, never hung.

    Phase 1, deterministic: the owner thread is inside an all_gather_consume
    (its consumer holds the op open until the intruder has tried) when the
    intruder calls all_gather_matmul on the same group, in 5 rounds; the
    intruder must be refused on every rank, locally, and the owner's op must
    complete on every rank, so the ranks' call sequences stay aligned.

    Phase 2, a free race: both threads call the same all_gather_matmul until
    the rank has 20 results, retrying after each refusal. Every call carries
    its thread's lane (``executor.lane``), so a call never pairs with the
    other thread's call on a peer: where the threads reach the group in
    different orders on different ranks, the ranks raise a commfuse error
    naming both threads (``MismatchError``; the group is then dead, and later
    calls say so). Every returned result must equal the reference exactly,
    and nothing but a commfuse error may be raised. Ends with one call from
    the main thread: right, or the commfuse error of a group the race ended.
    """
    import threading

    import commfuse as cf
    from commfuse.errors import CommfuseError, ConcurrentUseError
    from commfuse.runtime.groups import group_state

    rounds, race_calls = 5, 20
    timeout = caps["timeout_s"]
    group_name = group_state(be).name
    a_full, b, want = _exact_inputs(n, dev)
    a = a_full.tensor_split(n)[rank]
    problems, counts = out["problems"], {"owner_correct": 0, "refused": 0, "race_correct": 0, "race_refused": 0,
                                          "race_named": 0, "wrong": 0, "other": 0}
    out["figures"] = counts  # reported also when the case ends early
    lock = threading.Lock()

    def note(problem: str, counter: str = "other") -> None:
        with lock:
            counts[counter] += 1
            if len(problems) < 20:
                problems.append(problem)

    def check_refusal(e: BaseException, in_flight: str, thread: int | None, where: str) -> bool:
        """The refusal names the group, and the op in flight with its thread."""
        text = str(e)
        missing = [w for w in (group_name, f"{in_flight} (thread {thread})") if w not in text]
        if missing:
            note(f"{where}: the ConcurrentUseError does not name {missing}: {text}")
            return False
        return True

    # -- phase 1: the intruder calls while the owner is provably inside its op --------------------------------
    inside, tried = threading.Event(), threading.Event()
    owner_ident: list[int] = []

    def owner() -> None:
        owner_ident.append(threading.get_ident())
        for i in range(rounds):
            first = [True]

            def consumer(t, s, first=first):
                if first[0]:
                    first[0] = False
                    inside.set()
                    if not tried.wait(timeout):
                        note(f"round {i}: the intruder never tried within {timeout:g} s")
                    tried.clear()
                return (t @ b).clone()

            try:
                parts = cf.all_gather_consume(a, consumer, algorithm="ring", backend=be, timeout=timeout)
                got = torch.cat(parts, dim=0)
                if torch.equal(got.cpu(), want.cpu()):
                    with lock:
                        counts["owner_correct"] += 1
                else:
                    note(f"round {i}: the owner's all_gather_consume returned data that differs from the "
                         f"reference", "wrong")
            except Exception as e:  # noqa: BLE001 - counted and named
                note(f"round {i}: the owner's op raised {type(e).__name__}: {e}")
                inside.set()
                return

    def intruder() -> None:
        for i in range(rounds):
            if not inside.wait(2 * timeout):
                note(f"round {i}: the owner never entered its op")
                return
            inside.clear()
            try:
                y = cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)
                note(f"round {i}: the intruder's all_gather_matmul ran while all_gather_consume was in flight "
                     f"on {group_name} (it must be refused); "
                     + ("its result was right" if torch.equal(y.cpu(), want.cpu()) else "its result was WRONG"),
                     "other" if torch.equal(y.cpu(), want.cpu()) else "wrong")
            except ConcurrentUseError as e:
                if check_refusal(e, "all_gather_consume", owner_ident[0] if owner_ident else None,
                                 f"round {i}"):
                    with lock:
                        counts["refused"] += 1
            except Exception as e:  # noqa: BLE001
                note(f"round {i}: the intruder got {type(e).__name__} instead of ConcurrentUseError: {e}")
            finally:
                tried.set()

    _run_threads([owner, intruder], 3 * timeout + 10, problems)

    # -- phase 2: a free race for race_calls results -----------------------------------------------------------
    # the signature is planned and checked from this thread first: the check runs on a signature's first call,
    # and that call must be the same call on every rank, not whichever thread of each rank won a race
    y = cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)
    if not torch.equal(y.cpu(), want.cpu()):
        note("the warm-up all_gather_matmul returned data that differs from the reference", "wrong")
    left = [race_calls]
    racers: list[int] = []
    deadline = time.monotonic() + 2 * timeout + 5

    def racer() -> None:
        me = threading.get_ident()
        with lock:
            racers.append(me)
        while time.monotonic() < deadline:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            try:
                y = cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)
            except ConcurrentUseError as e:
                with lock:
                    left[0] += 1  # refused: the call did not happen, so it is still owed
                other = next((r for r in racers if r != me), None)  # the op in flight is the other racer's
                if check_refusal(e, "all_gather_matmul", other, "race"):
                    with lock:
                        counts["race_refused"] += 1
                time.sleep(0.0005)
                continue
            except CommfuseError as e:  # the threads met in different orders: named, and the group is ended
                with lock:
                    counts["race_named"] += 1
                    raised.append(f"{type(e).__name__}: {e}")
                return
            except Exception as e:  # noqa: BLE001
                note(f"race: all_gather_matmul raised {type(e).__name__} (expected a result or a commfuse "
                     f"error): {e}")
                return
            if torch.equal(y.cpu(), want.cpu()):
                with lock:
                    counts["race_correct"] += 1
            else:
                note("race: an all_gather_matmul returned data that differs from the reference", "wrong")
        note(f"race: the threads did not make {race_calls} calls within the deadline")

    raised: list[str] = []
    _run_threads([racer, racer], 2 * timeout + 10, problems)
    try:
        y = cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)
        if not torch.equal(y.cpu(), want.cpu()):
            note("the closing all_gather_matmul returned data that differs from the reference", "wrong")
    except CommfuseError as e:
        if not counts["race_named"]:
            note(f"the closing all_gather_matmul raised {type(e).__name__} although the race ended cleanly: {e}")
    if counts["refused"] != rounds:
        problems.append(f"the intruder was refused {counts['refused']} times in {rounds} rounds")
    if counts["owner_correct"] != rounds:
        problems.append(f"the owner completed {counts['owner_correct']} of {rounds} ops correctly")
    if counts["race_correct"] != race_calls and not counts["race_named"]:
        problems.append(f"the race returned {counts['race_correct']} correct results of {race_calls} and no "
                        "named error")
    if raised and not any("thread" in text for text in raised):
        problems.append(f"the race's errors do not name the threads: {raised[0][:300]}")


def _run_threads(targets, bound: float, problems: list) -> None:
    import threading

    threads = [threading.Thread(target=t, name=f"commfuse-conformance-{i}", daemon=True)
               for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + bound
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:  # daemon threads: the launch can still tear the rank down
        problems.append(f"threads {hung} still running after {bound:g} s: a hang")
        raise AssertionError(f"threads {hung} hung")


def _skipped_call(rank, n, be, dev, caps, out):
    """Rank 1's first call fails validation (it still takes a call number); then every rank makes the same
    valid calls. Rank 1 is one call ahead of its peers: no call may pair across the gap, so no rank returns
    data, and every rank ends in a named error."""
    import commfuse as cf
    from commfuse.errors import CommfuseValueError

    timeout = caps["timeout_s"]
    a_full, b, want = _exact_inputs(n, dev, seed=41)
    a = a_full.tensor_split(n)[rank]
    if rank == 1:
        try:
            cf.all_gather_matmul(a.flatten(), b, algorithm="ring", backend=be, timeout=timeout)
            out["problems"].append("all_gather_matmul accepted a 1-D a_shard")
        except CommfuseValueError:
            pass
    out["_since"] = time.monotonic()  # seconds: from the first valid call to the error
    out["figures"]["returned"] = 0
    for i in range(3):
        y = cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)
        out["figures"]["returned"] += 1
        if not torch.equal(y.cpu(), want.cpu()):
            out["problems"].append(f"valid call {i} returned data that differs from the reference (rank 1 is one "
                                   "call ahead of its peers: the call paired across the gap)")


def _symmetric_errors(rank, n, be, dev, caps, out):
    """Every rank fails the same way inside an op (a consumer that raises; a matmul the dtype cannot do), with
    transfers in flight: the error comes out unchanged, and the next valid op succeeds exactly."""
    import commfuse as cf
    from commfuse.errors import CommfuseError

    timeout = caps["timeout_s"]
    problems = out["problems"]
    a_full, b, want = _exact_inputs(n, dev, seed=51)
    a = a_full.tensor_split(n)[rank]
    calls, raised = [], []

    def consumer(t, s):
        calls.append(s)
        if len(calls) == 1:
            error = ZeroDivisionError(f"rank {rank}: the conformance suite's consumer fails on its first call")
            raised.append(error)
            raise error
        return t

    try:
        cf.all_gather_consume(a, consumer, algorithm="ring", backend=be, timeout=timeout)
        problems.append("all_gather_consume returned although its consumer raised")
    except ZeroDivisionError as e:
        if not raised or e is not raised[0]:
            problems.append(f"the consumer's ZeroDivisionError came out as another object: {e!r}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"the consumer's ZeroDivisionError came out as {type(e).__name__}: {e}")
    if len(calls) != 1:
        problems.append(f"the consumer was called {len(calls)} times (the op must stop at its error)")
    out["figures"]["consumer_calls"] = len(calls)

    def valid(after: str) -> None:
        y = cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)
        if not torch.equal(y.cpu(), want.cpu()):
            problems.append(f"the all_gather_matmul after {after} returned data that differs from the reference")

    valid("the consumer's error")
    bools = a.bool(), b.bool()
    try:
        cf.all_gather_matmul(*bools, algorithm="ring", backend=be, timeout=timeout)
        problems.append(f"a {bools[0].dtype} matmul did not raise on {dev}: the compute-error path was not "
                        "exercised")
    except CommfuseError as e:
        problems.append(f"the bool matmul's error came out wrapped as {type(e).__name__}: {e}")
    except (NotImplementedError, RuntimeError) as e:
        out["figures"]["compute_error"] = type(e).__name__
    valid("the failed bool matmul")


def _mismatch_promptness(rank, n, be, dev, caps, out):
    """Rank 2 calls with another shape: every rank, also those not beside rank 2, names it in seconds."""
    import commfuse as cf

    timeout = max(PROMPTNESS_TIMEOUT_S, caps["timeout_s"])
    out["figures"]["timeout_s"] = timeout
    rows = 6 if rank == 2 else 4
    cf.all_gather_matmul(torch.randn(rows, 16, device=dev), torch.randn(16, 4, device=dev), algorithm="ring",
                         backend=be, timeout=timeout)



# -- one rank fails, is late or is misled; the others are told, or unaffected ---------------------------------


class InjectedFault(ZeroDivisionError):
    """The fault the one-rank cases inject into rank 1's producer or consumer (a ZeroDivisionError, as a
    user's code would raise): its peers' errors must name it by this type's name."""


#: ``straggler``: rank 1 reaches its call this many timeouts after its peers.
STRAGGLER_LATE = 2.0
#: ``lying-split``: rank 0 sends rank 1 this many rows, and rank 1's ``output_splits`` claims the second.
LYING_SENT, LYING_CLAIMED = 5, 6


def _faulty(out: dict, raised: list, call):
    """The case's faulty call: its result, or None with ``out``'s kind, message and seconds saying how it
    ended. ``raised`` holds the fault this rank injected, if any: it must come out as the same object."""
    from commfuse.errors import CommfuseError

    t0 = time.monotonic()
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - judged by the suite, by kind and message
        out["kind"], out["message"] = type(e).__name__, str(e)
        if raised and e is not raised[0]:
            out["problems"].append(f"the injected {type(raised[0]).__name__} came out as another object: "
                                   f"{type(e).__name__}: {e}")
        elif not raised and not isinstance(e, CommfuseError):
            out["problems"].append(f"raised {type(e).__name__} (not a commfuse error): {e}\n"
                                   f"{traceback.format_exc(limit=6)}")
        return None
    finally:
        out["_took"] = time.monotonic() - t0


def _plain(rank, n, be, dev, timeout, out, calls: int, key: str = "after", seed: int = 81) -> None:
    """``calls`` plain ring all_gather_matmuls; ``figures[key]`` lists how each went: ``right``, ``wrong``, or
    the commfuse error it raised (then no more calls: the group is dead)."""
    import commfuse as cf
    from commfuse.errors import CommfuseError

    a_full, b, want = _exact_inputs(n, dev, seed=seed)
    a = a_full.tensor_split(n)[rank]
    went = out["figures"].setdefault(key, [])
    for i in range(calls):
        try:
            y = cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout)
        except CommfuseError as e:
            went.append(type(e).__name__)
            out["figures"][f"{key}_error"] = f"{type(e).__name__}: {e}"[:600]
            return
        except Exception as e:  # noqa: BLE001
            went.append(f"{type(e).__name__} (not a commfuse error)")
            out["problems"].append(f"plain call {i} ({key} the fault) raised {type(e).__name__}, not a commfuse "
                                   f"error: {e}")
            return
        right = torch.equal(y.cpu(), want.cpu())
        went.append("right" if right else "wrong")
        if not right:
            out["problems"].append(f"plain call {i} ({key} the fault) returned data that differs from the "
                                   "reference")


def _warm_up(rank, n, be, dev, timeout, out) -> None:
    """A plain call before the fault: the group works, and the ranks start the faulty call together."""
    _plain(rank, n, be, dev, timeout, out, 1, key="before", seed=79)


def _survives(out: dict, caps: dict) -> None:
    """Say in the figures whether this backend keeps the group usable after one rank's compute fails
    (``Capabilities.group_survives_one_rank_failure``): the suite judges the calls after the fault by it."""
    out["figures"]["survives"] = bool(caps.get("group_survives_one_rank_failure", True))


def _before(out: dict, right: bool) -> None:
    """How the call before the fault went: it plans and checks the faulty call's signature, so that the faulty
    call's peers wait in its transfers (not in its fingerprint check) and can learn of the fault only from the
    group's board."""
    out["figures"].setdefault("before", []).append("right" if right else "wrong")
    if not right:
        out["problems"].append("the call before the fault returned data that differs from the reference")


def _producer_raises(rank, n, be, dev, caps, out, where: str):
    """Rank 1's producer in a ring ``produce_reduce_scatter`` raises on the first partial it makes, before any
    transfer (``where="first"``: the group cannot complete the call and ends by name), or on the second
    (``"later"``: mid-ring, with sends of rank 1's still to come at three ranks or more, so its peers are told,
    or unaffected, and the group stays usable). The same call runs once without a fault first; plain calls
    follow."""
    import commfuse as cf

    timeout = caps["timeout_s"]
    _survives(out, caps)

    def partial(r: int, d: int) -> torch.Tensor:  # rank r's partial for rank d
        return _values((4, 8), torch.float32, 61 + 10 * r + d, True, dev)

    want = sum(partial(r, rank).double() for r in range(n))
    made, raised, armed = [], [], [False]  # armed: the fault may fire (the second call)

    def producer(d: int) -> torch.Tensor:
        made.append(d)
        if armed[0] and rank == 1 and len(made) == (1 if where == "first" else 2):
            raised.append(InjectedFault(f"rank 1's producer fails on its partial for rank {d} (injected by the "
                                        "conformance suite)"))
            raise raised[0]
        return partial(rank, d)

    def call() -> torch.Tensor:
        made.clear()
        return cf.produce_reduce_scatter(producer, algorithm="ring", backend=be, timeout=timeout)

    _before(out, torch.equal(call().double().cpu(), want.cpu()))
    armed[0] = True
    got = _faulty(out, raised, call)
    out["figures"]["partials_made"] = len(made)
    if got is not None:
        out["figures"]["result"] = "right" if torch.equal(got.double().cpu(), want.cpu()) else "wrong"
    _plain(rank, n, be, dev, timeout, out, 1 if where == "first" else 2)


def _consumer_raises(rank, n, be, dev, caps, out, which: str):
    """Rank 1's consumer in a ring ``all_gather_consume`` raises on the first shard it is given (its own) or
    on the last (after all its transfers): its peers are told or unaffected, and the group stays usable.
    The same call runs once without a fault first; plain calls follow."""
    import commfuse as cf

    timeout = caps["timeout_s"]
    _survives(out, caps)
    shards = [_values((4, 8), torch.float32, 71 + r, True, dev) for r in range(n)]
    given, raised, armed = [], [], [False]  # armed: the fault may fire (the second call)

    def consumer(t: torch.Tensor, s: int) -> torch.Tensor:
        given.append(s)
        if armed[0] and rank == 1 and len(given) == (1 if which == "first" else n):
            out["figures"]["failed_on_shard_of"] = s
            raised.append(InjectedFault(f"rank 1's consumer fails on the shard of rank {s} (injected by the "
                                        "conformance suite)"))
            raise raised[0]
        return t.clone()

    def call() -> list:
        given.clear()
        return cf.all_gather_consume(shards[rank], consumer, algorithm="ring", backend=be, timeout=timeout)

    def right(got) -> bool:
        return len(got) == n and all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, shards))

    _before(out, right(call()))
    armed[0] = True
    got = _faulty(out, raised, call)
    if got is not None:
        out["figures"]["result"] = "right" if right(got) else "wrong"
    _plain(rank, n, be, dev, timeout, out, 2)


def _in_place_consumer(rank, n, be, dev, caps, out):
    """Every rank's consumer doubles its tensor in place and keeps a copy, in a ring all_gather_consume and a
    ring all_to_all_consume: every result is twice the reference, and no rank's inputs change."""
    import commfuse as cf

    timeout = caps["timeout_s"]
    counts = out["figures"]
    counts.update(results=0, wrong=0, inputs_changed=0)

    def doubled(t: torch.Tensor, s: int) -> torch.Tensor:
        t.mul_(2)
        return t.clone()

    def compare(op: str, got, want, inputs, originals) -> None:
        for s, w in enumerate(want):
            counts["results"] += 1
            if s >= len(got) or not torch.equal(got[s].cpu(), 2 * w.cpu()):
                counts["wrong"] += 1
                out["problems"].append(f"{op}: the result for the shard of rank {s} is not twice the reference")
        for d, (t, o) in enumerate(zip(inputs, originals)):
            if not torch.equal(t.cpu(), o.cpu()):
                counts["inputs_changed"] += 1
                out["problems"].append(f"{op}: this rank's input {d} was changed by the consumers")

    shards = [_values((4, 8), torch.float32, 111 + r, True, dev) for r in range(n)]
    mine = shards[rank].clone()
    got = cf.all_gather_consume(mine, doubled, algorithm="ring", backend=be, timeout=timeout)
    compare("all_gather_consume", got, shards, [mine], [shards[rank]])

    def block(s: int, d: int) -> torch.Tensor:
        return _values((3, 8), torch.float32, 1000 + 10 * s + d, True, dev)

    chunks = [block(rank, d) for d in range(n)]
    got = cf.all_to_all_consume(chunks, doubled, algorithm="ring", backend=be, timeout=timeout)
    compare("all_to_all_consume", got, [block(s, rank) for s in range(n)], chunks,
            [block(rank, d) for d in range(n)])


def _lying_split(rank, n, be, dev, caps, out):
    """A ring all_to_all_consume over uneven chunks in which rank 1's ``output_splits`` claims
    :data:`LYING_CLAIMED` rows from rank 0, which sends :data:`LYING_SENT`: rank 1 raises naming rank 0 and
    both sizes, every other rank gets exactly its blocks, and the next plain call is right everywhere."""
    import commfuse as cf

    timeout = caps["timeout_s"]

    def rows(s: int, d: int) -> int:
        return LYING_SENT if (s, d) == (0, 1) else 1 + (s + d) % 3

    def block(s: int, d: int) -> torch.Tensor:
        return _values((rows(s, d), 3), torch.float32, 2000 + 10 * s + d, True, dev)

    splits = [rows(s, rank) for s in range(n)]
    if rank == 1:
        splits[0] = LYING_CLAIMED
    got = _faulty(out, [], lambda: cf.all_to_all_consume([block(rank, d) for d in range(n)], lambda t, s: t.clone(),
                                                         output_splits=splits, algorithm="ring", backend=be,
                                                         timeout=timeout))
    if got is not None:
        right = len(got) == n and all(torch.equal(g.cpu(), block(s, rank).cpu()) for s, g in enumerate(got))
        out["figures"]["result"] = "right" if right else "wrong"
    _plain(rank, n, be, dev, timeout, out, 1)


def _straggler(rank, n, be, dev, caps, out):
    """Rank 1 reaches a ring all_gather_matmul :data:`STRAGGLER_LATE` timeouts after its peers: they name it
    late at the timeout, and it hears that it was late as soon as it arrives. ``seconds`` count from each
    rank's entry into that call."""
    import commfuse as cf

    timeout = caps["timeout_s"]
    _warm_up(rank, n, be, dev, timeout, out)
    a_full, b, want = _exact_inputs(n, dev, seed=91)
    a = a_full.tensor_split(n)[rank]
    if rank == 1:
        time.sleep(STRAGGLER_LATE * timeout)
    got = _faulty(out, [], lambda: cf.all_gather_matmul(a, b, algorithm="ring", backend=be, timeout=timeout))
    if got is not None:
        out["figures"]["result"] = "right" if torch.equal(got.cpu(), want.cpu()) else "wrong"


_ROBUSTNESS = {
    "mismatched-shapes": _mismatched_shapes,
    "mismatched-algorithms": _mismatched_algorithms,
    "absent-peer": _absent_peer,
    "peer-death": _peer_death,
    "two-threads-one-group": _two_threads_one_group,
    "skipped-call": _skipped_call,
    "symmetric-consumer-error": _symmetric_errors,
    "mismatch-promptness": _mismatch_promptness,
    "producer-raises-first": functools.partial(_producer_raises, where="first"),
    "producer-raises-later": functools.partial(_producer_raises, where="later"),
    "consumer-raises-first": functools.partial(_consumer_raises, which="first"),
    "consumer-raises-last": functools.partial(_consumer_raises, which="last"),
    "in-place-consumer": _in_place_consumer,
    "lying-split": _lying_split,
    "straggler": _straggler,
}


TIERS = {"transport": transport, "schedules": schedules, "ops": ops, "determinism": determinism,
         "overlap": overlap, "capture": capture}
