"""Rank-side bodies of the one-rank failure tests (run inside ``commfuse.launch`` processes).

Each body returns plain data (strings, numbers, tuples) that the pytest side asserts on. Faults are
injected on ONE rank, in that rank's own process (a producer or consumer that raises, a hook that raises, a
rank that sleeps or is interrupted); every transfer is real gloo.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import commfuse as cf
from commfuse.ops import collect
from commfuse.errors import CommfuseError

#: Every op's timeout in these bodies. A rank told of a failure through the board raises long before it;
#: the tests assert less than half of it, which only the board can achieve.
TIMEOUT = 30.0


def _ints(shape, seed):
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).float()


class Injected(ZeroDivisionError):
    """The fault a body injects (a ZeroDivisionError, as a user's code would raise)."""


def _run(fn):
    """``("ok", fn())`` or ``(error type, message)``, with the seconds it took."""
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - reported by name
        return type(e).__name__, str(e), time.monotonic() - t0, isinstance(e, CommfuseError)
    return "ok", value, time.monotonic() - t0, False


def _agmm_check(rank, n, seed, group=None):
    """One ring all_gather_matmul; whether its result is right."""
    a, b = _ints((4, 8), 1000 * seed + rank), _ints((8, 5), seed)
    full = torch.cat([_ints((4, 8), 1000 * seed + r) for r in range(n)])
    return bool(torch.equal(cf.all_gather_matmul(a, b, algorithm="ring", timeout=TIMEOUT, group=group), full @ b))


def _after(rank, n, calls=3):
    """Plain calls after a failure: each is right, or raises a named commfuse error (never a wrong result).
    Their signature was called before the failure (:func:`_before`): the ranks have checked it, so a rank
    that checks it again after the failure while its peers do not would hang them."""
    return [_run(lambda i=i: _agmm_check(rank, n, 50 + i)) for i in range(calls)]


def _before(rank, n):
    """The plain calls' signature, called (and checked) once before the failure."""
    return _agmm_check(rank, n, 49)


# -- 1. a producer that raises on one rank -------------------------------------------------------------------


def producer_raises(rank, n, op, algorithm, where):
    """Rank 1's producer raises on the block or partial it makes first ("first": before any transfer) or on
    the second ("later": mid-ring, with rank 1's sends of what it made still to come); then three plain
    calls. Returns (the failing call's outcome, the next calls')."""
    _before(rank, n)
    step = -1 if op == "produce_reduce_scatter" else 1  # the ring makes for rank - 1 - k, or for rank + 1 + k
    bad = (rank + step * (1 if where == "first" else 2)) % n
    parts = {d: _ints((4, 6), 10 * rank + d) for d in range(n)}

    def producer(d):
        if rank == 1 and d == bad:
            raise Injected(f"rank 1's producer failed for rank {d}")
        return parts[d].clone()

    if op == "produce_reduce_scatter":
        want = sum(_ints((4, 6), 10 * r + rank) for r in range(n))
        failing = _run(lambda: bool(torch.equal(
            cf.produce_reduce_scatter(producer, algorithm=algorithm, timeout=TIMEOUT), want)))
    else:
        want = [_ints((4, 6), 10 * r + rank) for r in range(n)]
        failing = _run(lambda: all(torch.equal(x, w) for x, w in zip(
            cf.produce_all_to_all(producer, algorithm=algorithm, timeout=TIMEOUT), want)))
    return failing, _after(rank, n)


def broken_profile(rank, n, path):
    """Rank 1's hardware profile is broken (it reads another file than its peers): auto's policy fails
    there, before the call's first transfer. Returns (the call's outcome, the next calls')."""
    if rank == 1:
        os.environ["COMMFUSE_PROFILE"] = path
    a, b = _ints((64, 32), rank), _ints((32, 16), 7)
    full = torch.cat([_ints((64, 32), r) for r in range(n)])
    failing = _run(lambda: bool(torch.equal(cf.all_gather_matmul(a, b, timeout=TIMEOUT), full @ b)))
    os.environ.pop("COMMFUSE_PROFILE", None)
    return failing, _after(rank, n)


def two_threads(rank, n, calls):
    """Two threads share the group, each making ``calls`` ring calls with its own data; on even ranks thread
    0 makes the first call, on odd ranks thread 1 (the threads reach the group in different orders, as two
    racing threads do). Returns (right, wrong, errors named by commfuse, other errors) summed over both
    threads."""
    counts = {"right": 0, "wrong": 0, "named": 0, "other": 0}
    lock = threading.Lock()
    first, go = rank % 2, threading.Event()

    def worker(t):
        if t != first:
            go.wait(TIMEOUT)
        for i in range(calls):
            if i == 1 and t == first:
                go.set()
            seed = 100 * t + i
            try:
                ok = _agmm_check(rank, n, seed)
                key = "right" if ok else "wrong"
            except CommfuseError:
                key = "named"
            except Exception:  # noqa: BLE001
                key = "other"
            with lock:
                counts[key] += 1
        go.set()

    threads = [threading.Thread(target=worker, args=(t,), name=f"worker-{t}") for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    return counts


# -- 7 and 8. a consumer, an expert, an attention that raises on one rank -----------------------------------


def consumer_raises(rank, n, algorithm, source):
    """Rank 1's consumer raises when handed the shard of ``source`` ("own", "last": the last one it gets,
    after all its transfers, or "next": the first one it receives). Then three plain calls and a plain
    torch.distributed all_reduce. Returns (the call's outcome, the next calls', whether the all_reduce
    worked)."""
    _before(rank, n)
    a = _ints((4, 8), rank)
    full = torch.cat([_ints((4, 8), r) for r in range(n)])
    order = [(rank - k) % n for k in range(n)]  # the ring's: own shard first
    bad = {"own": order[0], "next": order[1], "last": order[-1]}[source]

    def consumer(t, s):
        if rank == 1 and s == bad:
            raise Injected(f"rank 1's consumer failed on the shard of rank {s}")
        return t.clone()

    failing = _run(lambda: bool(torch.equal(
        torch.cat(cf.all_gather_consume(a, consumer, algorithm=algorithm, timeout=TIMEOUT)), full)))
    after = _after(rank, n)
    x = torch.ones(1)
    try:
        dist.all_reduce(x)
        reduced = bool(x.item() == n)
    except Exception as e:  # noqa: BLE001
        reduced = f"{type(e).__name__}: {e}"
    return failing, after, reduced


def expert_raises(rank, n, algorithm):
    """One MoE forward in which rank 1's expert GEMM raises on the second block it computes (mid-dispatch).
    Returns (the forward's outcome, the next forwards')."""
    import commfuse.fused.moe as moe_module  # where the experts' GEMMs run
    from commfuse.nn import MoE

    torch.manual_seed(0)
    moe = MoE(16, 32, experts=2 * n, topk=2, algorithm=algorithm)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(rank))
    reference = moe(x).detach()  # the signature is planned and checked
    real = moe_module.grouped_mm
    seen = []

    def failing_mm(*args, **kwargs):
        seen.append(1)
        if rank == 1 and len(seen) == 2:
            raise Injected("rank 1's expert GEMM failed")
        return real(*args, **kwargs)

    moe_module.grouped_mm = failing_mm
    try:
        failing = _run(lambda: bool(torch.equal(moe(x), reference)))
    finally:
        moe_module.grouped_mm = real
    return failing, [_run(lambda: bool(torch.equal(moe(x), reference))) for _ in range(2)]


def attention_raises(rank, n):
    """A ParallelAttention forward in which rank 1's attention raises on its second query slice (the
    query-split reduce-scatter's producer, mid-ring). Returns (the forward's outcome, the next ones')."""
    import commfuse.fused.attention as attention_module  # where the attention lives
    from commfuse.nn import ParallelAttention

    torch.manual_seed(0)
    layer = ParallelAttention(48, 6, algorithm="ring")
    x = torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        reference = layer(x)
    real = attention_module.attend
    seen = []

    def failing_attend(*args, **kwargs):
        seen.append(1)
        if rank == 1 and len(seen) == 2:
            raise Injected("rank 1's attention failed")
        return real(*args, **kwargs)

    attention_module.attend = failing_attend
    try:
        with torch.no_grad():
            failing = _run(lambda: bool(torch.equal(layer(x), reference)))
    finally:
        attention_module.attend = real
    with torch.no_grad():
        return failing, [_run(lambda: bool(torch.equal(layer(x), reference))) for _ in range(2)]


# -- 9, 10, 11, 12 ---------------------------------------------------------------------------------------------


def straggler(rank, n, late_s, timeout):
    """Rank 1 reaches its second call ``late_s`` seconds after its peers; every op's timeout is
    ``timeout``. Returns the second call's outcome."""
    _agmm_check(rank, n, 1)
    if rank == 1:
        time.sleep(late_s)
    a, b = _ints((4, 8), rank), _ints((8, 5), 2)
    return _run(lambda: cf.all_gather_matmul(a, b, algorithm="ring", timeout=timeout).shape[0])


def interrupted(rank, n, after_s, peer_late_s):
    """Rank 0 waits in a call that rank 1 joins ``peer_late_s`` seconds late, and gets Ctrl-C (SIGINT to its
    own process) ``after_s`` seconds into the wait. Returns, on rank 0, (what it raised, the seconds from the
    signal to the exception); on rank 1, its call's outcome."""
    _agmm_check(rank, n, 1)
    a, b = _ints((4, 8), rank), _ints((8, 5), 2)
    if rank == 0:
        # Python's own Ctrl-C handler: a rank whose launcher was started with SIGINT ignored (a shell's background
        # job, a pytest-xdist worker) inherits it ignored, and the signal would reach no Python
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sent = []

        def interrupt():
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(after_s, interrupt)
        timer.start()
        try:
            cf.all_gather_matmul(a, b, algorithm="ring", timeout=TIMEOUT)
            return "no interrupt", None
        except KeyboardInterrupt:
            return "KeyboardInterrupt", time.monotonic() - sent[0]
        except BaseException as e:  # noqa: BLE001
            return type(e).__name__, str(e)
    time.sleep(peer_late_s)
    return _run(lambda: cf.all_gather_matmul(a, b, algorithm="ring", timeout=TIMEOUT).shape[0])


def new_signature_later(rank, n, repeats):
    """``repeats`` identical calls (the signature is checked on the first only), then rank 1 passes another
    shape. Returns the last call's outcome."""
    b = _ints((8, 5), 3)
    for _ in range(repeats):
        cf.all_gather_matmul(_ints((4, 8), rank), b, algorithm="ring", timeout=TIMEOUT)
    rows = 6 if rank == 1 else 4
    return _run(lambda: cf.all_gather_matmul(_ints((rows, 8), rank), b, algorithm="ring", timeout=TIMEOUT).shape)


def moe_auto_first_call(rank, n):
    """MoE(algorithm="auto")'s first forward on rank 0 while rank 1 never calls: its token count exchange
    must end at commfuse's timeout (COMMFUSE_TIMEOUT_S, set by the test), not the group's (two minutes
    under commfuse.launch). Returns rank 0's outcome."""
    from commfuse.nn import MoE

    moe = MoE(16, 32, experts=2 * n, topk=2)
    if rank == 0:
        return _run(lambda: moe(torch.randn(8, 16)).shape)
    time.sleep(float(os.environ["COMMFUSE_TIMEOUT_S"]) + 8)
    return None


# -- 13 and 5 --------------------------------------------------------------------------------------------------


def complex_vanilla(rank, n):
    """A complex64 shard gathered with vanilla (gloo has no complex collectives) and the ring."""
    shard = torch.complex(_ints((3, 4), rank), _ints((3, 4), 10 + rank))
    full = torch.cat([torch.complex(_ints((3, 4), r), _ints((3, 4), 10 + r)) for r in range(n)])
    out = {}
    for algorithm in ("vanilla", "ring", "sliced"):
        got = _run(lambda: bool(torch.equal(torch.cat(cf.all_gather_consume(
            shard, collect, algorithm=algorithm, timeout=TIMEOUT)), full)))
        out[algorithm] = got[:2]
    return out


def group_remade(rank, n):
    """Calls on the default group, and on a subgroup; the group destroyed (calls then: a cached signature, a
    new one, the old subgroup); the default group made again with the ranks in reverse order and called
    without commfuse.backends.release(). Returns the outcome of each step."""
    from torch.distributed import distributed_c10d as c10d

    out = {"before": _run(lambda: _agmm_check(rank, n, 1))[:2]}
    sub = dist.new_group(list(range(n)))
    out["subgroup"] = _run(lambda: _agmm_check(rank, n, 2, group=sub))[:2]
    store = c10d._get_default_store()
    dist.destroy_process_group()
    out["cached signature"] = _run(lambda: _agmm_check(rank, n, 1))[:2]
    out["new signature"] = _run(lambda: cf.all_gather_matmul(_ints((3, 8), rank), _ints((8, 5), 1),
                                                              algorithm="ring").shape)[:2]
    out["old subgroup"] = _run(lambda: _agmm_check(rank, n, 2, group=sub))[:2]
    again = n - 1 - rank
    dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=again, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    out["remade"] = _run(lambda: _agmm_check(again, n, 1))[:2]
    out["remade, new signature"] = _run(lambda: _agmm_check(again, n, 3))[:2]
    return out


def notes_of_an_earlier_numbering(rank, n):
    """The board's notes belong to one numbering of the group's calls. Rank 1's producer raises mid-ring in
    call #1 (its failure note on the board; the group stays usable); then the numbering starts again, and call
    #1 of the new numbering is a healthy ``produce_reduce_scatter`` that rank 2 joins 1.5 s late (past the
    grace period, so its peers read the board while they wait). Twice: after ``commfuse.backends.release()``
    on the same group, and on the default group made again on the same store (the documented recovery:
    destroy, release, init; under another prefix: gloo's own rendezvous cannot make a group again under the
    prefix of one it destroyed, it reads the old group's addresses). Returns each healthy call's outcome."""
    from torch.distributed import distributed_c10d as c10d

    parts = {d: _ints((4, 6), 10 * rank + d) for d in range(n)}
    want = sum(_ints((4, 6), 10 * r + rank) for r in range(n))

    def failing():
        bad = (rank - 2) % n  # the second partial rank 1 makes: its first was sent

        def producer(d):
            if rank == 1 and d == bad:
                raise Injected(f"rank 1's producer failed for rank {d}")
            return parts[d].clone()

        _run(lambda: cf.produce_reduce_scatter(producer, algorithm="ring", timeout=TIMEOUT))

    def healthy():
        if rank == 2:
            time.sleep(1.5)
        return bool(torch.equal(cf.produce_reduce_scatter(lambda d: parts[d].clone(), algorithm="ring",
                                                          timeout=TIMEOUT), want))

    out = {}
    base = c10d._get_default_store()

    def made_again(prefix):
        dist.destroy_process_group()
        cf.backends.release()
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, base), rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=60))

    for how in ("release", "group made again"):
        if how == "group made again":
            made_again("first")
        _before(rank, n)  # call #0
        failing()  # call #1: rank 1's note
        dist.barrier()
        if how == "release":
            cf.backends.release()
        else:
            made_again("again")
        _before(rank, n)  # call #0 of the new numbering
        out[how] = _run(healthy)[:2]  # call #1 of the new numbering
        out[how + ", then"] = _run(lambda: _agmm_check(rank, n, 60))[:2]
    return out


# -- a stream-ordered backend's watchdog reads the board (its pieces, on gloo) ------------------------------


def watchdog_reads_the_board(rank, n):
    """A stream-ordered backend's host never stalls in a wait, so its watchdog reads the board for a step
    pending past the grace period (``_StreamHandle.told``). The device path is UNVERIFIED here; its pieces
    run on gloo: rank 1 leaves call #1 before taking part (its note on the board), and rank 0 watches the
    first step of that call, which rank 1 never answers. Returns, on rank 0, what the watchdog reported and
    how long after the step was posted."""
    from commfuse.runtime.c10d import _StreamHandle
    from commfuse.runtime.compiled import Plan
    from commfuse.runtime.groups import group_state
    from commfuse.runtime.admission import announce_left, lane
    from commfuse.schedule import build
    from commfuse.runtime.watchdog import Watchdog
    from commfuse.schedule import SliceId, Transfer

    _agmm_check(rank, n, 1)  # call #0 of the group, on every rank
    be = cf.backends.resolve(None, None, "cpu")
    state = group_state(be)
    if rank == 1:
        announce_left(state, "all_gather_matmul", Injected("rank 1's policy failed"))
        time.sleep(8)
        return None
    plan = Plan(build("all_gather", n, algorithm="ring"), be, label="all_gather_matmul", timeout=TIMEOUT,
                check="once")
    plan.signature, plan.digest = (), 0
    state.lane = lane()
    code = state.lane[1]
    state.now = state.seqs.get(code, 0)  # this rank enters call #1
    state.seqs[code] = state.now + 1
    be.begin_call(0, plan)
    buf = torch.empty(4)
    step = be.post([], [(Transfer(SliceId(0), 1, 1, 0), buf)])
    handle = _StreamHandle(step.works, [buf], None, be, None)
    dog = Watchdog(poll_s=0.05)
    dog.exit = False
    reported = []
    t0 = time.monotonic()
    dog.watch(step.works, t0 + TIMEOUT, lambda cause: "expired", reported.append, handle.told)
    while not reported and time.monotonic() - t0 < TOLD_WITHIN:
        time.sleep(0.05)
    return [(type(e).__name__, str(e)) for e in reported], time.monotonic() - t0


#: How long ``watchdog_reads_the_board`` waits for the watchdog's report.
TOLD_WITHIN = 10.0
