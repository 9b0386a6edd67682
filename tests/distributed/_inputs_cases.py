"""Rank-side bodies of the input-safety tests (run inside ``commfuse.launch`` processes).

Each returns plain data (strings, numbers, tuples) that the pytest side asserts on.
"""

from __future__ import annotations

import logging
import time

import torch

import commfuse as cf
from commfuse.errors import CommfuseError, CommunicationError
from commfuse.runtime import record_events

TIMEOUT = 10.0


def _ints(shape, seed):
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


# -- 1. consumers that change what they are given ------------------------------------------------------------


def _doubled(t: torch.Tensor, source: int) -> torch.Tensor:
    return t.mul_(2).clone()  # changes its tensor in place, keeps what it made


def inplace_consumers(rank, n):
    """Every public consume op with a consumer that doubles its tensor in place: by algorithm, whether every
    result equals the reference and whether the caller's inputs are unchanged afterwards."""
    out = {}
    rows = 4
    shard = _ints((rows, 3), rank)
    for alg in ("ring", "ring:2", "bidirectional", "vanilla", "sliced"):
        mine = shard.clone()
        got = cf.all_gather_consume(mine, _doubled, algorithm=alg, timeout=TIMEOUT)
        want = [_ints((rows, 3), s) * 2 for s in range(n)]
        out[f"all_gather_consume {alg}"] = (all(torch.equal(g, w) for g, w in zip(got, want)),
                                            torch.equal(mine, shard))
        # the tensors handed over are the consumer's own: kept ones stay as they were made
        kept = cf.all_gather_consume(mine, lambda t, s: t.mul_(3), algorithm=alg, timeout=TIMEOUT)
        out[f"all_gather_consume {alg} kept"] = (all(torch.equal(g, w * 3 / 2) for g, w in zip(kept, want)),
                                                 torch.equal(mine, shard))

    even = [_ints((2, 3), 100 * rank + d) for d in range(n)]
    for alg in ("ring", "ring:2", "vanilla", "sliced"):
        chunks = [c.clone() for c in even]
        got = cf.all_to_all_consume(chunks, _doubled, algorithm=alg, timeout=TIMEOUT)
        want = [_ints((2, 3), 100 * s + rank) * 2 for s in range(n)]
        out[f"all_to_all_consume {alg}"] = (all(torch.equal(g, w) for g, w in zip(got, want)),
                                            all(torch.equal(c, e) for c, e in zip(chunks, even)))

    def rows_of(src, dst):  # what src sends dst (0 included)
        return (src + 2 * dst) % 3

    uneven = [_ints((rows_of(rank, d), 3), 100 * rank + d) for d in range(n)]
    for alg in ("ring", "ring:2", "vanilla", "sliced"):
        for given in (False, True):
            chunks = [c.clone() for c in uneven]
            splits = [rows_of(s, rank) for s in range(n)] if given else None
            got = cf.all_to_all_consume(chunks, _doubled, algorithm=alg, uneven=True, output_splits=splits,
                                        timeout=TIMEOUT)
            want = [_ints((rows_of(s, rank), 3), 100 * s + rank) * 2 for s in range(n)]
            out[f"all_to_all_consume uneven {alg}{' output_splits' if given else ''}"] = (
                all(torch.equal(g, w) for g, w in zip(got, want)),
                all(torch.equal(c, e) for c, e in zip(chunks, uneven)))
    return out


# -- 2. output_splits and input_splits that are not what the peers send ------------------------------------------


def _claims(actual: list[int], how: str, source: int) -> list[int]:
    claimed = list(actual)
    claimed[source] = {"larger": actual[source] + 2, "smaller": actual[source] - 1, "zero": 0}[how]
    return claimed


def lying_output_splits(rank, n, op, how):
    """Rank 1 claims a wrong ``output_splits[source]`` (source: the rank before it, which sends 3 rows); the
    others' splits are right. Per algorithm: (what the call gave, whether the next ordinary call is right)."""
    liar, source = 1, 0

    def rows(src, dst):  # 3 rows from the source to the liar, so that smaller and zero are lies too
        return 3 if (src, dst) == (source, liar) else 1 + (src + dst) % 2

    out = []
    for alg in ("ring", "vanilla"):
        actual = [rows(s, rank) for s in range(n)]
        splits = _claims(actual, how, source) if rank == liar else actual
        want = [_ints((rows(s, rank), 2), 10 * s + rank) for s in range(n)]
        try:
            if op == "all_to_all_consume":
                got = cf.all_to_all_consume([_ints((rows(rank, d), 2), 10 * rank + d) for d in range(n)],
                                            lambda t, s: t.clone(), output_splits=splits, algorithm=alg,
                                            timeout=TIMEOUT)
            else:
                # ring: with input_splits (each block made in its step); vanilla: without (made up front)
                got = cf.produce_all_to_all(lambda d: _ints((rows(rank, d), 2), 10 * rank + d), output_splits=splits,
                                            input_splits=[rows(rank, d) for d in range(n)] if alg == "ring" else None,
                                            algorithm=alg, timeout=TIMEOUT)
            result = ("ok", all(torch.equal(g, w) for g, w in zip(got, want)))
        except CommfuseError as e:
            result = _error(e)
        # the next ordinary call on the group
        after = cf.all_gather_consume(_ints((2, 2), rank), cf.ops.collect, algorithm="ring", timeout=TIMEOUT)
        after_ok = all(torch.equal(a, _ints((2, 2), s)) for s, a in enumerate(after))
        out.append((alg, result, after_ok))
    return out


def lying_input_splits(rank, n):
    """Rank 1's producer returns 2 more rows for rank 0 than its ``input_splits`` declare."""
    liar, dest = 1, 0

    def produce(d):
        rows = 2 + (2 if (rank, d) == (liar, dest) else 0)
        return _ints((rows, 2), 10 * rank + d)

    out = []
    for alg in ("ring", "vanilla"):
        start = time.perf_counter()
        try:
            cf.produce_all_to_all(produce, input_splits=[2] * n, algorithm=alg, timeout=3)
            result = ("ok", "", False)
        except CommfuseError as e:
            result = (*_error(e), isinstance(e, CommunicationError))
        seconds = time.perf_counter() - start
        after = cf.all_gather_consume(_ints((2, 2), rank), cf.ops.collect, algorithm="ring", timeout=TIMEOUT)
        after_ok = all(torch.equal(a, _ints((2, 2), s)) for s, a in enumerate(after))
        out.append((alg, result, seconds, after_ok))
    return out


# -- 3. layers built with other options on one rank -----------------------------------------------------------------


def _layer(which: str, odd: bool, n: int):
    """(the layer, its input maker): ``odd`` builds it with the one option that differs."""
    from commfuse.nn import (
        ColumnParallelLinear,
        ParallelAttention,
        ParallelMLP,
        RowParallelLinear,
        ShardedLinear,
        UlyssesAttention,
    )

    torch.manual_seed(0)
    h = 4 * n
    if which == "ulysses causal":
        return UlyssesAttention(h, 2 * n, causal=not odd, algorithm="ring"), (2, 3, h)
    if which == "ulysses heads":  # the same widths cut into other heads
        return UlyssesAttention(h, n if odd else 2 * n, algorithm="ring"), (2, 3, h)
    if which == "parallel attention causal":
        return ParallelAttention(h, 2 * n, causal=not odd, algorithm="ring"), (2, 3, h)
    if which == "parallel attention heads":
        return ParallelAttention(h, n if odd else 2 * n, algorithm="ring"), (2, 3, h)
    if which == "column bias":
        return ColumnParallelLinear(h, 2 * n, bias=odd, algorithm="ring"), (2, 3, h)
    if which == "row bias":
        return RowParallelLinear(2 * n, h, bias=odd, algorithm="ring"), (2, 3 * n, 2)
    if which == "mlp activation":
        return ParallelMLP(h, 2 * n, activation="relu" if odd else "gelu", algorithm="ring"), (2, 3, h)
    if which == "sharded reduce":
        return ShardedLinear(h, 2 * n, reduce="sum" if odd else "avg", algorithm="ring"), (3, h)
    if which == "sharded bias":
        return ShardedLinear(h, 2 * n, bias=not odd, algorithm="ring"), (3, h)
    raise ValueError(which)


def layer_mismatch(rank, n, which):
    """The last rank builds the layer with one option changed: (kind, message, seconds) of its forward; then
    whether the same layer built alike on every rank still runs."""
    layer, shape = _layer(which, rank == n - 1, n)
    x = _ints(shape, rank)
    start = time.perf_counter()
    try:
        layer(x)
        got = ("ok", "")
    except CommfuseError as e:
        got = _error(e)
    seconds = time.perf_counter() - start
    alike, shape = _layer(which, False, n)
    try:
        y = alike(_ints(shape, rank))
        y.sum().backward()
        after = bool(torch.isfinite(y).all())
    except CommfuseError as e:
        after = _error(e)
    return got, seconds, after


class _Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.wo = torch.nn.Linear(hidden, hidden, bias=False)


def _swap_qk(q, k):  # a "rope" that is not the identity: it changes what is computed, not the shapes
    return q.flip(1), k.flip(1)


def tp_attention_mismatch(rank, n, which):
    """commfuse.tp.AttentionParallel with the mask or the rope hook different on the last rank: what each rank
    raised, applying the style (where the ranks' agreement names it) or in the block's first call, and how long
    it took."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse.tp import AttentionParallel

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    odd = rank == n - 1

    def build(odd):
        torch.manual_seed(0)
        root = torch.nn.Module()
        root.attention = _Block(4 * n)
        style = AttentionParallel(head_dim=2, algorithm="ring",
                                  causal=not odd if which == "causal" else True,
                                  rope=_swap_qk if which == "rope" and odd else None)
        return parallelize_module(root, mesh["tp"], {"attention": style}).attention

    start = time.perf_counter()
    try:
        block = build(odd)
        block(_ints((2, 3, 4 * n), rank))
        got = ("ok", "")
    except CommfuseError as e:
        got = _error(e)
    seconds = time.perf_counter() - start
    alike = build(False)
    y = alike(_ints((2, 3, 4 * n), rank))
    y.sum().backward()
    return got, seconds, bool(torch.isfinite(y).all())


# -- 4. more slices than rows ---------------------------------------------------------------------------------------


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record) -> None:
        self.said.append(record.getMessage())


def capped_slices(rank, n, m):
    """Every op with ``ring:m`` (m far more than the 4 rows of the smallest shard): per op, (result right,
    the algorithm reported, the steps that ran, what was warned)."""
    said = _Said()
    logging.getLogger("commfuse").addHandler(said)
    out = {}
    rows = 4
    alg = f"ring:{m}"

    def run(name, fn, check):
        report: dict = {}
        del said.said[:]
        with record_events() as events:
            got = fn(report)
        out[name] = (bool(check(got)), report.get("algorithm"), len(events), list(said.said))

    shard = _ints((rows, 3), rank)
    everyone = torch.cat([_ints((rows, 3), s) for s in range(n)])
    b = _ints((3, 2), 99)
    run("all_gather_consume", lambda r: cf.all_gather_consume(shard, cf.ops.collect, algorithm=alg, timeout=TIMEOUT,
                                                              report=r),
        lambda got: torch.equal(torch.cat(got), everyone))
    run("all_gather_consume again", lambda r: cf.all_gather_consume(shard, cf.ops.collect, algorithm=alg,
                                                                    timeout=TIMEOUT, report=r),
        lambda got: torch.equal(torch.cat(got), everyone))
    run("all_gather_matmul", lambda r: cf.all_gather_matmul(shard, b, algorithm=alg, timeout=TIMEOUT, report=r),
        lambda got: torch.equal(got, everyone @ b))
    # gathered_size 4n - 1: tensor_split shards of 4 and 3 rows; the smallest (3) caps
    uneven = _ints((rows if rank < n - 1 else rows - 1, 3), rank)
    whole = torch.cat([_ints((rows if s < n - 1 else rows - 1, 3), s) for s in range(n)])
    run("all_gather_matmul uneven", lambda r: cf.all_gather_matmul(uneven, b, gathered_size=rows * n - 1,
                                                                   algorithm=alg, timeout=TIMEOUT, report=r),
        lambda got: torch.equal(got, whole @ b))
    a = _ints((rows * n, 3), 7 + rank)
    total = sum(_ints((rows * n, 3), 7 + s) for s in range(n)) @ b
    run("matmul_reduce_scatter", lambda r: cf.matmul_reduce_scatter(a, b, algorithm=alg, timeout=TIMEOUT, report=r),
        lambda got: torch.equal(got, total.tensor_split(n)[rank]))
    run("produce_reduce_scatter", lambda r: cf.produce_reduce_scatter(
        lambda d: (a @ b).tensor_split(n)[d].contiguous(), algorithm=alg, timeout=TIMEOUT, report=r),
        lambda got: torch.equal(got, total.tensor_split(n)[rank]))
    chunks = [_ints((rows, 3), 10 * rank + d) for d in range(n)]
    run("all_to_all_consume", lambda r: cf.all_to_all_consume(chunks, cf.ops.collect, algorithm=alg, timeout=TIMEOUT,
                                                              report=r),
        lambda got: all(torch.equal(g, _ints((rows, 3), 10 * s + rank)) for s, g in enumerate(got)))
    run("produce_all_to_all", lambda r: cf.produce_all_to_all(lambda d: _ints((rows, 3), 10 * rank + d),
                                                              algorithm=alg, timeout=TIMEOUT, report=r),
        lambda got: all(torch.equal(g, _ints((rows, 3), 10 * s + rank)) for s, g in enumerate(got)))
    logging.getLogger("commfuse").removeHandler(said)
    return out
