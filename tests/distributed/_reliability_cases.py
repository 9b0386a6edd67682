"""Rank-side bodies of the reliability tests (run inside ``commfuse.launch`` processes).

Each returns plain data (strings, numbers, tuples) that the pytest side asserts on.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

import commfuse as cf
from commfuse.errors import CommfuseError
from commfuse.runtime.c10d import C10dBackend
from commfuse.runtime.groups import FINGERPRINT_CHANNEL


def _ints(shape, seed):
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).float()


class CountingBackend(C10dBackend):
    """The gloo backend, counting the fingerprint messages it posts (real transfers, nothing faked)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks = 0

    def post(self, sends, recvs):
        if any(t.channel == FINGERPRINT_CHANNEL for t, _ in sends):
            self.checks += 1
        return super().post(sends, recvs)


def check_once(rank, n):
    """How many fingerprint hops each call costs: first call of a signature, repeats, new signatures,
    ``check="always"``, and the call after a failed one."""
    from commfuse.plugins.builtin import commfuse_backends

    be = CountingBackend(name="gloo")
    be.capabilities = next(s for s in commfuse_backends() if s.name == "gloo").capabilities
    a, b = _ints((4, 8), rank), _ints((8, 5), 99)
    full = torch.cat([_ints((4, 8), r) for r in range(n)])
    counts = {}

    def run(name, fn, *args, **kwargs):
        before = be.checks
        out = fn(*args, **kwargs)
        counts[name] = be.checks - before
        return out

    def agmm(x, w, **kw):
        return cf.all_gather_matmul(x, w, algorithm=kw.pop("algorithm", "ring"), backend=be, timeout=30, **kw)

    ok = True
    ok &= torch.equal(run("first", agmm, a, b), full @ b)
    ok &= all(torch.equal(run(f"repeat{i}", agmm, a, b), full @ b) for i in range(5))
    ok &= torch.equal(run("new-shape", agmm, a[:3], b), torch.cat([_ints((4, 8), r)[:3] for r in range(n)]) @ b)
    ok &= torch.equal(run("new-dtype", agmm, a.double(), b.double()), (full @ b).double())
    ok &= torch.equal(run("new-algorithm", agmm, a, b, algorithm="bidirectional"), full @ b)
    ok &= torch.equal(run("always-1", agmm, a, b, check="always"), full @ b)
    ok &= torch.equal(run("always-2", agmm, a, b, check="always"), full @ b)
    ok &= torch.equal(run("off", agmm, a[:2], b, check=False), torch.cat([_ints((4, 8), r)[:2] for r in range(n)]) @ b)
    try:  # fails before communicating, on every rank: the next call on the group is checked again
        agmm(a.flatten(), b)
    except CommfuseError:
        pass
    ok &= torch.equal(run("after-failure", agmm, a, b), full @ b)
    ok &= torch.equal(run("then-repeat", agmm, a, b), full @ b)
    pair = dist.new_group(list(range(n)))  # same ranks, another group: another signature
    ok &= torch.equal(run("new-group", lambda: cf.all_gather_matmul(a, b, algorithm="ring", group=pair,
                                                                    timeout=30)), full @ b)
    return ok, counts


def mismatch_later(rank, n, check, shapes):
    """Signatures agreed on the first calls; then rank 1 passes another shape. ``shapes``: the row counts
    every rank calls first (rank 1's later shape among them: a signature it has already checked)."""
    b = _ints((8, 5), 99)
    for rows in shapes:  # the very signature the ranks but rank 1 call next: they will not check it again
        cf.all_gather_matmul(_ints((rows, 8), rank), b, algorithm="ring", timeout=8, check=check)
    t0 = time.monotonic()
    try:
        cf.all_gather_matmul(_ints((4 if rank != 1 else 6, 8), rank), b, algorithm="ring", timeout=8,
                             check=check)
    except CommfuseError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def two_ops_decoded(rank, n):
    """Rank 0 calls all_gather_matmul, rank 1 matmul_reduce_scatter: each side read with its own format."""
    try:
        if rank == 0:
            cf.all_gather_matmul(_ints((4, 8), 0), _ints((8, 5), 1), algorithm="ring", timeout=30)
        else:
            cf.matmul_reduce_scatter(_ints((8, 8), 0), _ints((8, 5), 1), algorithm="ring", timeout=30)
    except CommfuseError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def two_threads(rank, n):
    """Two threads on one group: one is inside an op when the other starts one."""
    a, b = _ints((4, 8), rank), _ints((8, 5), 99)
    full = torch.cat([_ints((4, 8), r) for r in range(n)])
    inside, go_on = threading.Event(), threading.Event()
    got: dict = {}

    def consumer(t, s):
        inside.set()
        go_on.wait(10)
        return t.clone()

    def first():
        got["first"] = cf.all_gather_consume(a, consumer, algorithm="ring", timeout=30)

    worker = threading.Thread(target=first)
    worker.start()
    inside.wait(10)
    try:
        cf.all_gather_matmul(a, b, algorithm="ring", timeout=30)
        second = ("no error", "")
    except CommfuseError as e:
        second = (type(e).__name__, str(e))
    go_on.set()
    worker.join(30)
    first_ok = torch.equal(torch.cat(got["first"]), full)
    after_ok = torch.equal(cf.all_gather_matmul(a, b, algorithm="ring", timeout=30), full @ b)
    return second, first_ok, after_ok


def skipped_call(rank, n):
    """The issue's case: rank 1's first call fails validation; every rank then makes the same two valid
    calls. Returns per call ("ok" and whether it equals the reference) or the error."""
    a, b = _ints((4, 8), rank), _ints((8, 5), 99)
    full = torch.cat([_ints((4, 8), r) for r in range(n)])
    a2 = _ints((4, 8), 10 + rank)
    full2 = torch.cat([_ints((4, 8), 10 + r) for r in range(n)])
    out = []
    if rank == 1:
        try:
            cf.all_gather_matmul(a.flatten(), b, algorithm="ring", timeout=8)
        except CommfuseError as e:
            out.append(("validation", type(e).__name__))
    t0 = time.monotonic()
    for x, want in ((a, full @ b), (a2, full2 @ b)):
        try:
            y = cf.all_gather_matmul(x, b, algorithm="ring", timeout=8)
            out.append(("ok", bool(torch.equal(y, want))))
        except CommfuseError as e:
            out.append((type(e).__name__, str(e)))
    return out, time.monotonic() - t0


def symmetric_failure(rank, n):
    """Every rank raises inside its consumer, or its compute fails mid-ring; the next op must work."""
    a, b = _ints((4, 8), rank), _ints((8, 5), 99)
    full = torch.cat([_ints((4, 8), r) for r in range(n)])
    seen = []

    def consumer(t, s):
        seen.append(s)
        return 1 / 0

    try:
        cf.all_gather_consume(a, consumer, algorithm="ring", timeout=20)
        first = "no error"
    except ZeroDivisionError:
        first = "ZeroDivisionError"
    after1 = torch.equal(cf.all_gather_matmul(a, b, algorithm="ring", timeout=20), full @ b)
    try:  # matmul of bool tensors is not implemented: the compute of the first step raises
        cf.all_gather_matmul(a.bool(), b.bool(), algorithm="ring", timeout=20)
        second = "no error"
    except (RuntimeError, NotImplementedError) as e:
        second = type(e).__name__
    after2 = torch.equal(cf.all_gather_matmul(a, b, algorithm="ring", timeout=20), full @ b)
    return first, after1, second, after2


def auto_on_uneven_shards(rank, n):
    """tensor_split shards of 4/3/3 rows and a backend whose auto threshold lies between a 3-row and a
    4-row shard: every rank must take the same algorithm, and the result must be right."""
    from commfuse.plugins import Capabilities

    be = cf.backends.get("gloo")
    row = 8 * 4  # bytes of one fp32 row of 8
    be.capabilities = Capabilities(bidirectional_links=True, overlap=True, auto_min_slice_bytes=row * 4 - 1)
    total = 3 * n + 1
    full = _ints((total, 8), 5)
    shard = full.tensor_split(n)[rank]
    b = _ints((8, 5), 6)
    report: dict = {}
    y = cf.all_gather_matmul(shard, b, gathered_size=total, backend=be, report=report, timeout=30)
    return report["algorithm"], bool(torch.equal(y, full @ b))


def uneven_whole_collectives(rank, n):
    """gathered_size that does not divide, with the whole-collective baselines (and the ring, to compare)."""
    total = 3 * n + 1
    full = _ints((total, 8), 5)
    shard = full.tensor_split(n)[rank]
    b = _ints((8, 5), 6)
    rows = _ints((2, total, 8), 7)
    out = {}
    for alg in ("vanilla", "sliced", "sliced:3", "ring", "bidirectional"):
        try:
            y = cf.all_gather_matmul(shard, b, gathered_size=total, algorithm=alg, timeout=30)
            ok = torch.equal(y, full @ b)
            z = cf.matmul_reduce_scatter(rows, b, scatter_dim=1, algorithm=alg, timeout=30)
            want = (rows @ b).tensor_split(n, dim=1)[rank] * n
            ok = ok and torch.equal(z, want)
            out[alg] = "ok" if ok else "wrong result"
        except Exception as e:  # noqa: BLE001 - reported by name
            out[alg] = f"{type(e).__name__}: {e}"
    return out


class FailingPost(C10dBackend):
    """The gloo backend whose posts fail on rank 0 as a transport's would (a RuntimeError from c10d)."""

    def post(self, sends, recvs):
        if self.rank == 0:
            raise RuntimeError("connection reset by peer (injected)")
        return super().post(sends, recvs)


def posting_error(rank, n):
    be = FailingPost(name="gloo")
    try:
        cf.all_gather_matmul(_ints((4, 8), rank), _ints((8, 5), 1), algorithm="ring", backend=be, check=False,
                             timeout=5)
    except CommfuseError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def watchdog_fires(rank, n):
    """A stream-ordered wait does not block the host; the watchdog names the step that outlived its
    deadline. Here on gloo works: rank 0 posts a receive that rank 1 answers only after the deadline."""
    from commfuse.runtime.watchdog import Watchdog

    if rank == 0:
        dog = Watchdog(poll_s=0.05)
        buf = torch.empty(16)
        work = dist.group.WORLD.recv([buf], 1, 77)
        errors = []
        t0 = time.monotonic()
        dog.watch([work], t0 + 0.5, lambda cause: "rank 0: receive from rank 1 (step 3 of test) timed out",
                  errors.append)
        while not errors and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        fired_after = time.monotonic() - t0
        dist.barrier()  # rank 1 sends now
        work.wait()
        done = Watchdog(poll_s=0.05)
        finished = dist.group.WORLD.recv([buf], 1, 78)
        finished.wait()
        quiet = []
        done.watch([finished], time.monotonic() + 0.2, lambda cause: "should not fire", quiet.append)
        time.sleep(0.5)
        done.poll()
        return [str(e) for e in errors], fired_after, quiet, bool(buf[0] == 78)
    dist.barrier()
    dist.group.WORLD.send([torch.full((16,), 77.0)], 0, 77).wait()
    dist.group.WORLD.send([torch.full((16,), 78.0)], 0, 78).wait()
    return None
