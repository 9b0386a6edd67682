"""Checks of the XLA lowering: trace every op for every rank of a world, parse the HLO, compare with the schedule.

XLA:CPU cannot execute collectives across devices, but tracing needs no
second device: an :class:`~commfuse_xla.backend.XlaBackend` made with an
explicit ``rank`` and ``world_size`` traces that rank's program on the one
CPU device, and ``torch_xla._XLAC._get_xla_tensors_hlo`` lowers it to HLO
text without running it (the checks assert that no computation was
executed). For every rank the parsed HLO must show, against the schedule the
op ran (``commfuse.schedule.build``):

* exactly the schedule's collective-permutes: N-1 per channel (ring) times
  the parts per shard, each with ``source_target_pairs`` equal to
  ``Ring(N).pairs(shift)`` of the step and channel it carries;
* the permutes chained in schedule order (each depends on the one before);
* the dots interleaved with them as the schedule says, read from the data
  dependencies (the HLO's textual order is not a schedule): for the
  all-gather and all-to-all forms each dot depends on exactly the permutes up
  to the one that delivered its last slice, so it can run while the next
  permute is in flight; for the reduce-scatter forms no dot depends on a
  permute, and the first permute that depends on a dot is the one sending
  that dot's running sum in the following step;
* for ``vanilla`` and ``sliced``: one all-gather / reduce-scatter /
  all-to-all per chunk over the whole group, and no permute.

``python -m commfuse_xla.verify --world-sizes 1 2 3 4 8`` runs everything
(world size 1 also executes each op on the device and compares with the
reference) and prints one line per world size and case.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from dataclasses import dataclass, field

import torch

from commfuse.schedule import Collective, Ring, build, parse_algorithm
from commfuse_xla import hlo
from commfuse_xla.backend import XlaBackend, global_pairs, hop_slice

#: Shapes of the traced problems: a shard has ROWS rows of K columns; the weights have N_OUT columns.
ROWS, K, N_OUT = 4, 8, 3


@dataclass(frozen=True)
class Case:
    op: str  # all_gather_matmul | matmul_reduce_scatter | all_gather_consume | produce_reduce_scatter | all_to_all_consume
    algorithm: str

    @property
    def collective(self) -> Collective:
        return {
            "all_gather_matmul": Collective.ALL_GATHER,
            "all_gather_consume": Collective.ALL_GATHER,
            "matmul_reduce_scatter": Collective.REDUCE_SCATTER,
            "produce_reduce_scatter": Collective.REDUCE_SCATTER,
            "all_to_all_consume": Collective.ALL_TO_ALL,
        }[self.op]

    @property
    def per_shard(self) -> bool:
        """The consume/produce forms compute once per shard; the matmul ops once per step."""
        return self.op in ("all_gather_consume", "produce_reduce_scatter", "all_to_all_consume")

    def schedule(self, world_size: int):
        spec = parse_algorithm(self.algorithm, self.collective)
        return build(self.collective, world_size, algorithm=spec.schedule_algorithm, parts=spec.parts,
                     chunks=spec.chunks)

    def __str__(self) -> str:
        return f"{self.op}[{self.algorithm}]"


CASES = (
    *(Case("all_gather_matmul", a) for a in ("ring", "bidirectional", "ring:2", "vanilla", "sliced")),
    *(Case("matmul_reduce_scatter", a) for a in ("ring", "bidirectional", "ring:2", "vanilla", "sliced")),
    *(Case("all_gather_consume", a) for a in ("ring", "bidirectional")),
    *(Case("produce_reduce_scatter", a) for a in ("ring", "bidirectional")),
    *(Case("all_to_all_consume", a) for a in ("ring", "vanilla")),
)


# -- the problems, per rank -----------------------------------------------------


def _inputs(case: Case, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Deterministic CPU inputs of ``rank`` (integer-valued, so float32 sums are exact)."""
    g = torch.Generator().manual_seed(1000 * world_size + rank)

    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=g).to(torch.float32)

    w = torch.randint(-3, 4, (K, N_OUT), generator=torch.Generator().manual_seed(7)).to(torch.float32)
    if case.op in ("all_gather_matmul", "all_gather_consume"):
        return {"a": ints(ROWS, K), "w": w}
    if case.op in ("matmul_reduce_scatter", "produce_reduce_scatter"):
        return {"a": ints(ROWS * world_size, K), "w": w}
    return {"chunks": ints(world_size, ROWS, K), "w": w}


def run_op(case: Case, backend, inputs: dict[str, torch.Tensor], device) -> list[torch.Tensor]:
    """Run ``case`` on ``backend`` with ``inputs`` moved to ``device``; the op's result tensors."""
    import commfuse as cf

    x = {k: v.to(device) for k, v in inputs.items()}
    w = x["w"]
    opts = dict(backend=backend, algorithm=case.algorithm, check=False)
    with torch.no_grad():
        if case.op == "all_gather_matmul":
            return [cf.all_gather_matmul(x["a"], w, **opts)]
        if case.op == "matmul_reduce_scatter":
            return [cf.matmul_reduce_scatter(x["a"], w, **opts)]
        if case.op == "all_gather_consume":
            return list(cf.all_gather_consume(x["a"], lambda t, s: t @ w, **opts))
        if case.op == "produce_reduce_scatter":
            a = x["a"]
            return [cf.produce_reduce_scatter(lambda d: a[d * ROWS : (d + 1) * ROWS] @ w, **opts)]
        chunks = list(x["chunks"].unbind(0))
        return list(cf.all_to_all_consume(chunks, lambda t, s: t @ w, **opts))


def reference(case: Case, world_size: int, rank: int) -> list[torch.Tensor]:
    """What ``rank`` must get, computed on the CPU from every rank's inputs."""
    every = [_inputs(case, r, world_size) for r in range(world_size)]
    w = every[0]["w"]
    if case.op == "all_gather_matmul":
        return [torch.cat([e["a"] for e in every]) @ w]
    if case.op == "all_gather_consume":
        return [e["a"] @ w for e in every]
    if case.op in ("matmul_reduce_scatter", "produce_reduce_scatter"):
        total = sum(e["a"] @ w for e in every)
        return [total[rank * ROWS : (rank + 1) * ROWS]]
    return [every[s]["chunks"][rank] @ w for s in range(world_size)]


# -- tracing ------------------------------------------------------------------------


def _executions() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return 0 if data is None else int(data[0])


def trace(case: Case, rank: int, world_size: int) -> str:
    """The HLO text of ``rank``'s program for ``case`` at ``world_size``, traced on one device, never run."""
    import torch_xla

    device = torch_xla.device()
    backend = XlaBackend(rank=rank, world_size=world_size, device=device)
    before = _executions()
    outputs = run_op(case, backend, _inputs(case, rank, world_size), device)
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    if _executions() != before:
        raise AssertionError(f"{case} rank {rank}/{world_size}: tracing executed a computation")
    forget(device)
    return text


def forget(device) -> None:
    """Drop what was traced on ``device`` without running it, the collective token included.

    torch_xla threads a token through every collective of a device until the
    next sync, so without this each trace's HLO would also hold every earlier
    trace's collectives (and a sync would try to run them).
    """
    import torch_xla

    torch_xla._XLAC._clear_pending_irs(str(device))
    torch_xla._XLAC._set_all_reduce_token(str(device), None)


# -- checks -------------------------------------------------------------------------


@dataclass
class RankResult:
    rank: int
    permutes_per_channel: dict[int, int] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)
    dots: int = 0
    failures: list[str] = field(default_factory=list)


def _chunks(collective: Collective) -> str:
    return {Collective.ALL_GATHER: "all-gather", Collective.REDUCE_SCATTER: "reduce-scatter",
            Collective.ALL_TO_ALL: "all-to-all"}[collective]


def check_rank(case: Case, world_size: int, rank: int, text: str) -> RankResult:
    """Compare one rank's HLO with the schedule; failures are listed, not raised."""
    result = RankResult(rank)
    fail = result.failures.append
    entry = hlo.parse(text).entry
    schedule = case.schedule(world_size)
    ring = Ring(world_size)
    everyone = [list(range(world_size))]
    steps = schedule.steps(rank)
    permutes = entry.topological([i.name for i in entry.of("collective-permute")])
    dots = [i.name for i in entry.of("dot")]
    result.dots = len(dots)
    collective_ops = {op: len(entry.of(op)) for op in ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")}
    result.collectives = {k: v for k, v in collective_ops.items() if v}

    if schedule.algorithm.value in ("vanilla", "sliced"):
        op = _chunks(case.collective)
        want = sum(len(s.collectives) for s in steps)
        if permutes:
            fail(f"{len(permutes)} collective-permutes in a {schedule.algorithm} schedule")
        if collective_ops[op] != want:
            fail(f"{collective_ops[op]} {op} ops, the schedule has {want}")
        for ins in entry.of(op):
            if [list(g) for g in ins.replica_groups] != everyone:
                fail(f"{ins.name} has replica_groups {ins.replica_groups}, expected {everyone}")
        if case.collective is not Collective.REDUCE_SCATTER:
            # Every dot reads gathered data, except a per-shard consumer's call on this rank's own shard.
            alone = [d for d in dots if not any(entry.depends(d, c.name) for c in entry.of(op))]
            if len(alone) > (1 if case.per_shard else 0):
                fail(f"{alone} do not depend on any {op}")
        return result

    # The schedule's permutes, in order: one per receive (each receive is matched to a send by the backend).
    expected = [(s.index, t.channel, t.shift, t.slice) for s in steps for t in s.recvs]
    for _, channel, _, _ in expected:
        result.permutes_per_channel[channel] = result.permutes_per_channel.get(channel, 0) + 1
    if len(permutes) != len(expected):
        fail(f"{len(permutes)} collective-permutes, the schedule has {len(expected)}")
        return result
    for i in range(1, len(permutes)):
        if not entry.depends(permutes[i], permutes[i - 1]):
            fail(f"permute {i} ({permutes[i]}) does not follow permute {i - 1} ({permutes[i - 1]})")
    for i, (name, (step, channel, shift, _)) in enumerate(zip(permutes, expected)):
        got = [list(p) for p in entry.instructions[name].source_target_pairs]
        want = global_pairs(ring, everyone, shift)
        if got != want:
            fail(f"permute {i} (step {step}, channel {channel}, shift {shift}) has pairs {got}, expected {want}")
    for d in dots:
        others = [c.name for c in entry.of("all-gather") + entry.of("reduce-scatter") + entry.of("all-to-all")]
        if any(entry.depends(d, c) for c in others):
            fail(f"{d} depends on a whole collective in a ring schedule")

    # The compute, grouped as the op calls it: per step (matmul ops) or per shard (consume/produce forms).
    compute_step = {x: s.index for s in steps for x in s.compute}
    if case.per_shard:
        groups = collections.defaultdict(list)
        for s in steps:
            for x in s.compute:
                groups[x.source if x.source is not None and case.collective is Collective.ALL_TO_ALL else x.shard].append(x)
        groups = list(groups.values())
    else:
        groups = [list(s.compute) for s in steps if s.compute]

    perm_of = {name: i for i, name in enumerate(permutes)}
    if case.collective is Collective.REDUCE_SCATTER:
        sent = [hop_slice(ring, x, shift) for _, _, shift, x in expected]  # what this rank sends in permute i

        def first_send(x):
            after = [i for i, (step, *_rest) in enumerate(expected) if sent[i] == x and step > compute_step[x]]
            return min(after) if after else None

        want = sorted((min((v for v in map(first_send, g) if v is not None), default=-1) for g in groups))
        got = []
        for d in dots:
            if any(entry.depends(d, p) for p in permutes):
                fail(f"{d} depends on a collective-permute: a partial must need nothing received")
            users = [perm_of[p] for p in permutes if entry.depends(p, d)]
            got.append(min(users) if users else -1)
        got.sort()
    else:
        arrival = {x: i for i, (*_rest, x) in enumerate(expected)}
        want = sorted(max((arrival.get(x, -1) for x in g), default=-1) for g in groups)
        got = []
        for d in dots:
            if any(entry.depends(p, d) for p in permutes):
                fail(f"a collective-permute depends on {d}: all-gather hops carry received data only")
            needed = [perm_of[p] for p in permutes if entry.depends(d, p)]
            got.append(max(needed) if needed else -1)
        got.sort()
    if len(got) != len(want):
        fail(f"{len(got)} dots, the schedule computes {len(want)} times")
    elif got != want:
        what = "first permute that sends each dot's sum" if case.collective is Collective.REDUCE_SCATTER else \
            "last permute each dot waits for"
        fail(f"dots out of schedule order: {what} is {got}, the schedule says {want}")
    return result


def check_world(case: Case, world_size: int) -> list[RankResult]:
    return [check_rank(case, world_size, r, trace(case, r, world_size)) for r in range(world_size)]


def run_world_one(case: Case) -> list[str]:
    """Execute ``case`` at world size 1 on the XLA device and compare with the reference; failures."""
    import torch_xla

    device = torch_xla.device()
    backend = XlaBackend(rank=0, world_size=1, device=device)
    outputs = run_op(case, backend, _inputs(case, 0, 1), device)
    torch_xla.sync()
    got = [t.cpu() for t in outputs]
    want = reference(case, 1, 0)
    if len(got) != len(want) or any(not torch.equal(g, w) for g, w in zip(got, want)):
        return [f"world size 1 result differs from the reference: {got} vs {want}"]
    return []


def execute_here() -> list[str]:
    """Run every case on this process's XLA device with the runtime's ranks and compare with the reference.

    What a TPU (or XLA:GPU) host runs to verify the lowering by execution:
    ``python -m commfuse_xla.verify --execute`` starts one process per device
    with ``torch_xla.launch``; on XLA:CPU that is one process (world size 1).
    """
    import torch_xla

    backend = XlaBackend()
    n, rank = backend.world_size, backend.rank
    failures = []
    for case in CASES:
        outputs = run_op(case, backend, _inputs(case, rank, n), backend.device)
        torch_xla.sync()
        got, want = [t.cpu() for t in outputs], reference(case, n, rank)
        if len(got) != len(want) or any(not torch.equal(g, w) for g, w in zip(got, want)):
            failures.append(f"rank {rank}/{n} {case}: the result differs from the reference")
    return failures


def _execute_main(index: int = 0) -> None:
    failures = execute_here()
    backend = XlaBackend()
    for f in failures:
        print(f"FAIL {f}", flush=True)
    print(f"rank {backend.rank} of {backend.world_size}: {len(CASES) - len(failures)} passed, {len(failures)} failed",
          flush=True)
    if failures:
        raise SystemExit(1)


# -- command line -------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m commfuse_xla.verify", description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    p.add_argument("--show-hlo", metavar="CASE", help="print rank 0's HLO of this case (e.g. 'all_gather_matmul[ring]')")
    p.add_argument("--execute", action="store_true",
                   help="instead: execute every case on all local devices (torch_xla.launch) against the reference")
    args = p.parse_args(argv)
    if args.execute:
        import torch_xla

        torch_xla.launch(_execute_main)
        return 0
    failed = 0
    for n in args.world_sizes:
        t0 = time.perf_counter()
        for case in CASES:
            if n == 1:
                failures = run_world_one(case)
                line = "executed on the device, equals the reference" if not failures else failures[0]
            else:
                results = check_world(case, n)
                failures = [f"rank {r.rank}: {f}" for r in results for f in r.failures]
                first = results[0]
                if first.permutes_per_channel:
                    perms = ", ".join(f"channel {c}: {k}" for c, k in sorted(first.permutes_per_channel.items()))
                    line = f"collective-permutes per rank ({perms}), {first.dots} dots, pairs and order as scheduled"
                else:
                    line = f"{first.collectives} per rank, no permutes, {first.dots} dots"
                if args.show_hlo == str(case):
                    print(trace(case, 0, n))
            status = "ok  " if not failures else "FAIL"
            print(f"{status} world {n} {str(case):40s} {line if not failures else failures[0]}")
            for f in failures[1:5]:
                print(f"       {f}")
            failed += bool(failures)
        print(f"-- world size {n}: {len(CASES)} cases in {time.perf_counter() - t0:.1f} s", flush=True)
    total = len(CASES) * len(args.world_sizes)
    print(f"{total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
