"""Rank-side bodies of the conformance suite, one per tier.

Each runs many cases in one process group and returns
``{case: {"error": None | text, "figures": {...}}}``; the pytest side
(``suite``) turns every case into its own test. ``backend_ref`` is a
registered backend name or ``module:factory``.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist

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
                    if alg.startswith("bidirectional"):
                        return
                    blocks = [_values((3, 4), dtype, 1000 * rank + d, exact, dev) for d in range(n)]
                    got = cf.all_to_all_consume(blocks, lambda t, s: t.clone(), algorithm=alg, backend=be,
                                                timeout=timeout)
                    for s in range(n):
                        _same(got[s], _values((3, 4), dtype, 1000 * s + rank, exact, dev), True, f"block from {s}")

                _case(results, f"all_gather-{alg}-{dname}-{tier}", ag)
                _case(results, f"reduce_scatter-{alg}-{dname}-{tier}", rs)
                _case(results, f"all_to_all-{alg}-{dname}-{tier}", a2a)
    return results


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
    if caps["autograd"]:
        for alg in ("ring", "vanilla"):
            if alg in caps["algorithms"]:
                _case(results, f"autograd-mlp-{alg}", lambda alg=alg: _mlp_grads(rank, n, be, alg, dev))
                _case(results, f"autograd-ops-{alg}", lambda alg=alg: _op_grads(rank, n, be, alg, dev))
    return results


def _mlp_grads(rank, n, be, alg, dev):
    from torch import nn

    from commfuse.nn import ParallelMLP
    from commfuse.nn._common import gather_dim

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
    _same(mlp.fc2.bias.grad, fc2.bias.grad, False, "fc2 bias grad")


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


def overlap(rank: int, n: int, ref: str, caps: dict) -> dict:
    import commfuse as cf
    from commfuse.runtime import measure

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    results: dict = {}
    a = torch.randn(512, 512, device=dev)
    b = torch.randn(512, 1024, device=dev)

    def timed(mode):
        samples = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            with measure(mode):
                cf.all_gather_matmul(a, b, algorithm="ring", backend=be)
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[len(samples) // 2]

    def hidden():
        timed(None)  # warm up
        total, comp, comm = timed(None), timed("compute_only"), timed("comm_only")
        fraction = max(0.0, min(1.0, (comp + comm - total) / comm)) if comm > 0 else 1.0
        figures = {"total_ms": 1e3 * total, "compute_only_ms": 1e3 * comp, "comm_only_ms": 1e3 * comm,
                   "hidden_fraction": fraction}
        if fraction < caps["overlap_threshold"]:
            raise AssertionError(f"ring hid {fraction:.2f} of its communication, below the backend's threshold "
                                 f"{caps['overlap_threshold']}: {figures}")
        return figures

    _case(results, "ring-hides-communication", hidden)
    return results


# -- robustness: each case in its own launch --------------------------------------------------------------


def robustness(rank: int, n: int, ref: str, caps: dict, kind: str):
    """Returns (error type, message, seconds) for every rank that raised, or ("no error", "", seconds)."""
    import commfuse as cf
    from commfuse.errors import CommfuseError

    dev = rank_device(caps["device"], rank)
    be = backend_from(ref, device=dev)
    timeout = caps["timeout_s"]
    t0 = time.monotonic()
    try:
        if kind == "mismatched-shapes":
            rows = 8 if rank == 0 else 4
            cf.all_gather_matmul(torch.randn(rows, 16, device=dev), torch.randn(16, 4, device=dev),
                                 algorithm="ring", backend=be, timeout=timeout)
        elif kind == "mismatched-algorithms":
            cf.matmul_reduce_scatter(torch.randn(8, 16, device=dev), torch.randn(16, 4, device=dev),
                                     algorithm="ring" if rank == 0 else "vanilla", backend=be, timeout=timeout)
        elif kind == "absent-peer":
            if rank == 1:
                time.sleep(timeout + 3)
                return ("absent", "", time.monotonic() - t0)
            cf.all_gather_matmul(torch.randn(4, 16, device=dev), torch.randn(16, 4, device=dev), algorithm="ring",
                                 backend=be, timeout=timeout, check=False)
        elif kind == "peer-death":
            calls = []

            def consumer(t, s):
                calls.append(s)
                if rank == 1 and len(calls) == 1:  # mid-schedule: step 0 posted, step 1 never will be
                    os.kill(os.getpid(), signal.SIGKILL)
                return None

            cf.all_gather_consume(torch.randn(64, 64, device=dev), consumer, algorithm="ring", backend=be,
                                  timeout=timeout)
            cf.all_gather_consume(torch.randn(64, 64, device=dev), consumer, algorithm="ring", backend=be,
                                  timeout=timeout)
    except CommfuseError as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("no error", "", time.monotonic() - t0)


TIERS = {"transport": transport, "schedules": schedules, "ops": ops, "determinism": determinism,
         "overlap": overlap}
