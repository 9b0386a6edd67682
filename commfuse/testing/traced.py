"""The traced tier's cases: commfuse's ops run as one program on N devices, against the reference semantics.

A backend whose ranks are the devices of one traced program (the JAX
lowering: the rank is a value of the graph) cannot be launched as processes,
so the other tiers' rank bodies do not apply to it. It names a *runner*
instead (``Capabilities.traced_runner``, ``module:function``)::

    outputs, grads = run(body, inputs, world_size, cotangents)

* ``body(*tensors)`` is one device's program on the backend's tensors: it
  calls commfuse's public ops (a consumer or producer in it is given the
  rank as the backend gives it, a traced 0-d tensor on JAX) and returns one
  tensor;
* ``inputs`` is one list per argument of ``world_size`` CPU tensors, rank r's
  at index r; ``cotangents`` is one CPU tensor per rank, shaped as its output;
* ``outputs`` are the ``world_size`` results and ``grads``, one list per
  argument, the gradient of ``sum over r of <output r, cotangent r>`` with
  respect to rank r's argument, all as CPU tensors in the inputs' dtype.

Each case here gives the per-rank inputs and the per-rank reference, written
with :mod:`commfuse.schedule`'s reference semantics over per-rank lists
(``all_gather_ref``, ``reduce_scatter_ref``, ``all_to_all_ref``) in float64,
differentiated by torch for the gradients. Inputs of the matmul, consume and
produce forms are integer-valued and small, so every result is exact in
float32 and bfloat16 and must match bit for bit; ring attention (exp,
division) is held to the suite's tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from commfuse.schedule import Collective, all_gather_ref, all_to_all_ref, parse_algorithm, reduce_scatter_ref

#: The ops a traced backend runs (``Capabilities.whole_ops`` of its plugin record), as the tier names them.
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_gather_consume", "produce_reduce_scatter",
       "all_to_all_consume", "ring_attention-contiguous", "ring_attention-zigzag")
_COLLECTIVE = {"all_gather_matmul": Collective.ALL_GATHER, "matmul_reduce_scatter": Collective.REDUCE_SCATTER,
               "all_gather_consume": Collective.ALL_GATHER, "produce_reduce_scatter": Collective.REDUCE_SCATTER,
               "all_to_all_consume": Collective.ALL_TO_ALL, "ring_attention-contiguous": Collective.ALL_GATHER,
               "ring_attention-zigzag": Collective.ALL_GATHER}
#: Rows of a shard, the contraction and the output width of the matmul problems; ring attention's shapes.
ROWS, K, M = 3, 8, 6
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 4, 2, 8


def cases(algorithms, dtypes) -> list[str]:
    """``traced-{op}-{algorithm}-{dtype}`` for every op and every algorithm its collective has."""
    names = []
    for op in OPS:
        for alg in algorithms:
            if _applies(op, alg):
                names += [f"traced-{op}-{alg}-{d}" for d in dtypes]
    return names


def _applies(op: str, algorithm: str) -> bool:
    """The all-to-all has no bidirectional ring: the pairwise exchange has no direction to split."""
    return not (_COLLECTIVE[op] is Collective.ALL_TO_ALL and parse_algorithm(algorithm).name == "bidirectional")


@dataclass(frozen=True)
class Problem:
    """One case: ``inputs[i][r]`` rank r's argument i; ``body`` one device's program; ``reference(*leaves)`` every
    rank's result from every rank's arguments (float64, differentiable); ``exact`` whether it must match bit for
    bit."""

    inputs: list
    body: Callable
    reference: Callable
    exact: bool


def problem(op: str, algorithm: str, dtype: torch.dtype, n: int, seed: int = 0) -> Problem:
    """The inputs, the device program and the reference of one case at world size ``n``."""
    import commfuse as cf

    g = torch.Generator().manual_seed(1000 * n + seed)

    def ints(*shape):
        return torch.randint(-1, 2, shape, generator=g).to(dtype)

    def per_rank(*shape):
        return [ints(*shape) for _ in range(n)]

    alg = algorithm
    if op == "all_gather_matmul":  # a (2, ROWS, K) per rank gathered along dim 1, each rank its own b
        def body(a, b):
            return cf.all_gather_matmul(a, b, gather_dim=1, algorithm=alg)

        def reference(a, b):
            return [torch.cat(shards, dim=1) @ b[r] for r, shards in enumerate(all_gather_ref(a))]
        return Problem([per_rank(2, ROWS, K), per_rank(K, M)], body, reference, True)
    if op == "matmul_reduce_scatter":  # a (2, n*ROWS, K) per rank, scattered along dim 1
        def body(a, b):
            return cf.matmul_reduce_scatter(a, b, scatter_dim=1, algorithm=alg)

        def reference(a, b):
            return reduce_scatter_ref([list((a[r] @ b[r]).tensor_split(n, dim=1)) for r in range(n)])
        return Problem([per_rank(2, n * ROWS, K), per_rank(K, M)], body, reference, True)
    if op == "all_gather_consume":  # consumer(shard of s, s) = shard @ w + s, results stacked in rank order
        def body(x, w):
            return torch.stack(cf.all_gather_consume(x, lambda t, s: t @ w + s, algorithm=alg))

        def reference(x, w):
            return [torch.stack([t @ w[r] + s for s, t in enumerate(shards)]) for r, shards in enumerate(all_gather_ref(x))]
        return Problem([per_rank(ROWS, K), per_rank(K, M)], body, reference, True)
    if op == "produce_reduce_scatter":  # producer(d) = a's rows for d @ w + d
        def body(a, w):
            return cf.produce_reduce_scatter(lambda d, a, w: a.view(n, ROWS, K)[d] @ w + d, inputs=(a, w),
                                             algorithm=alg)

        def reference(a, w):
            return reduce_scatter_ref([[a[r].view(n, ROWS, K)[d] @ w[r] + d for d in range(n)] for r in range(n)])
        return Problem([per_rank(n * ROWS, K), per_rank(K, M)], body, reference, True)
    if op == "all_to_all_consume":  # block d of x to rank d; consumer(block from s, s) = block @ w + s
        def body(x, w):
            return torch.stack(cf.all_to_all_consume(list(x.view(n, ROWS, K).unbind(0)), lambda t, s: t @ w + s,
                                                     algorithm=alg))

        def reference(x, w):
            got = all_to_all_ref([list(x[r].view(n, ROWS, K).unbind(0)) for r in range(n)])
            return [torch.stack([t @ w[r] + s for s, t in enumerate(blocks)]) for r, blocks in enumerate(got)]
        return Problem([per_rank(n * ROWS, K), per_rank(K, M)], body, reference, True)
    if op.startswith("ring_attention-"):
        return _attention(op.partition("-")[2], alg, dtype, n, g)
    raise ValueError(f"unknown traced op {op!r}")


def _attention(layout: str, alg: str, dtype, n: int, g) -> Problem:
    """Causal grouped-query attention over a sequence of n*SEQ positions, each rank holding its ``layout`` shard;
    the reference attends over the whole sequence (unsharded by ``commfuse.context``) and cuts it again."""
    import commfuse as cf
    from commfuse.context import shard_sequence, unshard_sequence

    def normal(*shape):
        return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]

    def body(q, k, v):
        return cf.ring_attention(q, k, v, causal=True, layout=layout, algorithm=alg)

    def reference(q, k, v):
        q, k, v = (unshard_sequence(list(x), layout) for x in (q, k, v))
        k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=2) for x in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM ** 0.5
        length = s.shape[-1]
        s = s.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)
        return [shard_sequence(out, r, n, layout) for r in range(n)]
    return Problem([normal(BATCH, SEQ, HEADS, HEAD_DIM), normal(BATCH, SEQ, KV_HEADS, HEAD_DIM),
                    normal(BATCH, SEQ, KV_HEADS, HEAD_DIM)], body, reference, False)


@dataclass(frozen=True)
class Prepared:
    """A case made ready: its problem, every rank's cotangent, and the reference's outputs and gradients
    (``grads[i][r]``: of argument i on rank r)."""

    problem: Problem
    cotangents: list
    want: list
    grads: list


def prepare(case: str, n: int) -> Prepared:
    """The problem of ``case`` (a name from :func:`cases`) at world size ``n``, with the reference's answers."""
    from commfuse.testing._bodies import EXACT_DTYPES

    rest, _, dname = case.removeprefix("traced-").rpartition("-")
    op = next((o for o in sorted(OPS, key=len, reverse=True) if rest.startswith(o + "-")), None)
    if op is None:
        raise ValueError(f"unknown traced case {case!r}: its op is none of {OPS}")
    p = problem(op, rest[len(op) + 1:], EXACT_DTYPES[dname], n)
    leaves = [[t.double().requires_grad_(True) for t in arg] for arg in p.inputs]
    want = p.reference(*leaves)
    g = torch.Generator().manual_seed(7)
    cotangents = [torch.randint(-1, 2, w.shape, generator=g).to(p.inputs[0][0].dtype) for w in want]
    flat = torch.autograd.grad(sum((w * c.double()).sum() for w, c in zip(want, cotangents)),
                               [t for arg in leaves for t in arg])
    grads = [list(flat[i * n:(i + 1) * n]) for i in range(len(p.inputs))]
    return Prepared(p, cotangents, [w.detach() for w in want], grads)


def compare(prepared: Prepared, outputs, grads) -> list[str]:
    """What a runner returned against the reference: the failures, as lines naming the rank (``grads`` None:
    the outputs only)."""
    from commfuse.testing._bodies import _same

    n = len(prepared.want)
    if len(outputs) != n:
        return [f"the runner returned {len(outputs)} outputs for {n} ranks"]
    failures = []

    def same(got, expected, what):
        try:
            _same(got, expected, prepared.problem.exact, what)
        except AssertionError as e:
            failures.append(str(e))

    for r in range(n):
        same(outputs[r], prepared.want[r], f"rank {r}: output")
    for i, per_rank in enumerate(prepared.grads if grads is not None else ()):
        if len(grads[i]) != n:
            failures.append(f"the runner returned {len(grads[i])} gradients of argument {i} for {n} ranks")
            continue
        for r in range(n):
            same(grads[i][r], per_rank[r], f"rank {r}: gradient of argument {i}")
    return failures


def check(run: Callable, case: str, n: int) -> list[str]:
    """Run ``case`` through the backend's runner ``run`` at world size ``n``, forward and backward; the
    failures, as lines naming the rank and what differs."""
    prepared = prepare(case, n)
    outputs, grads = run(prepared.problem.body, prepared.problem.inputs, n, prepared.cotangents)
    if grads is None or len(grads) != len(prepared.problem.inputs):
        return [f"the runner returned {'no' if grads is None else len(grads)} gradient lists for "
                f"{len(prepared.problem.inputs)} arguments"]
    return compare(prepared, outputs, grads)
