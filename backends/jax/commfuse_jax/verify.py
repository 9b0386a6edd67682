"""The JAX lowering executed on host devices: every op and algorithm against the reference, and its HLO.

``python -m commfuse_jax.verify`` runs, on CPU host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set here before jax
is imported), every case below at world sizes 2, 3, 4 and 8, in float32 and
bfloat16, forward and backward, through commfuse's public ops on torchax
tensors inside ``jax.jit(shard_map(...))``, and prints one line per case with
the largest error against the reference (plain torch in float64 on the
gathered tensors, with the same inputs rounded to the dtype). Inputs of the
matmul and consume forms are integer-valued, so float32 must be exact there.

``--hlo`` also checks each case's lowered HLO (``jit(...).lower(...)``,
parsed by :mod:`commfuse.testing.hlo`) in the ``shard_map`` body computation,
against the schedule the op walks (:func:`check_hlo`). ``--processes 2``
runs the cases across two processes of two devices each
(``jax.distributed.initialize``, gloo CPU collectives) and checks that both
report the same errors.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from dataclasses import dataclass

if "jax" not in sys.modules and __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

#: Rows of a shard, the contraction and the output width of the matmul problems; ring attention's shapes.
ROWS, K, M = 4, 8, 6
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 4, 2, 8


@dataclass(frozen=True)
class Case:
    op: str
    algorithm: str
    layout: str = "contiguous"

    def __str__(self) -> str:
        return f"{self.op}[{self.algorithm}{'' if self.layout == 'contiguous' else ', ' + self.layout}]"

    @property
    def collective(self) -> str:
        return {"all_gather_matmul": "all_gather", "all_gather_consume": "all_gather", "ring_attention": "all_gather",
                "matmul_reduce_scatter": "reduce_scatter", "produce_reduce_scatter": "reduce_scatter",
                "all_to_all_consume": "all_to_all"}[self.op]


CASES = (
    *(Case("all_gather_matmul", a) for a in ("ring", "bidirectional", "ring:2", "sliced:2", "vanilla")),
    *(Case("matmul_reduce_scatter", a) for a in ("ring", "bidirectional", "ring:2", "sliced:2", "vanilla")),
    *(Case("all_gather_consume", a) for a in ("ring", "bidirectional", "vanilla")),
    *(Case("produce_reduce_scatter", a) for a in ("ring", "bidirectional", "vanilla")),
    *(Case("all_to_all_consume", a) for a in ("ring", "ring:2", "vanilla")),
    Case("ring_attention", "ring"), Case("ring_attention", "vanilla"), Case("ring_attention", "ring", "zigzag"),
)


# -- the problems --------------------------------------------------------------------------------------------------


def _problem(case: Case, n: int, seed: int = 0):
    """``(inputs, specs, body, reference)``: global float64 torch inputs and their shard_map specs; ``body(*t)``,
    the per-device computation on torchax tensors (commfuse's public ops), returning this device's result with
    a leading dim of 1; ``reference(*t)``, the stacked results of every device, in plain torch."""
    import torch
    import commfuse as cf
    from jax.sharding import PartitionSpec as P

    g = torch.Generator().manual_seed(1000 * n + seed)

    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=g).to(torch.float64)

    alg = case.algorithm
    if case.op == "all_gather_matmul":
        def body(x, w):
            return cf.all_gather_matmul(x, w, algorithm=alg)[None]

        def reference(x, w):
            return (x @ w)[None].expand(n, -1, -1)
        return [ints(n * ROWS, K), ints(K, M)], (P("tp"), P()), body, reference
    if case.op == "matmul_reduce_scatter":
        def body(a, w):
            return cf.matmul_reduce_scatter(a, w, algorithm=alg)[None]

        def reference(a, w):
            return sum(a.view(n, n * ROWS, K)[d] @ w for d in range(n)).view(n, ROWS, M)
        return [ints(n * n * ROWS, K), ints(K, M)], (P("tp"), P()), body, reference
    if case.op == "all_gather_consume":
        def body(x, w):
            return torch.stack(cf.all_gather_consume(x, lambda t, s: t @ w + s.to(t.dtype), algorithm=alg))[None]

        def reference(x, w):
            per_source = torch.stack([x.view(n, ROWS, K)[s] @ w + s for s in range(n)])
            return per_source[None].expand(n, -1, -1, -1)
        return [ints(n * ROWS, K), ints(K, M)], (P("tp"), P()), body, reference
    if case.op == "produce_reduce_scatter":
        def body(a, w):
            def producer(d, a, w):
                return a.view(n, ROWS, K)[d] @ w * (d + 1).to(a.dtype)
            return cf.produce_reduce_scatter(producer, inputs=(a, w), algorithm=alg)[None]

        def reference(a, w):
            return torch.stack([sum(a.view(n, n, ROWS, K)[q, d] @ w for q in range(n)) * (d + 1) for d in range(n)])
        return [ints(n * n * ROWS, K), ints(K, M)], (P("tp"), P()), body, reference
    if case.op == "all_to_all_consume":
        def body(x, w):
            chunks = list(x.view(n, ROWS, K).unbind(0))
            return torch.stack(cf.all_to_all_consume(chunks, lambda t, s: t @ w + s.to(t.dtype), algorithm=alg))[None]

        def reference(x, w):
            blocks = x.view(n, n, ROWS, K)  # [source, destination]
            return torch.stack([torch.stack([blocks[s, d] @ w + s for s in range(n)]) for d in range(n)])
        return [ints(n * n * ROWS, K), ints(K, M)], (P("tp"), P()), body, reference

    def normal(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64)

    layout = case.layout

    def body(q, k, v):
        return cf.ring_attention(q, k, v, causal=True, layout=layout, algorithm=alg)[None]

    def reference(q, k, v):
        rows = torch.arange(n * SEQ)
        r, i = rows // SEQ, rows % SEQ
        half = SEQ // 2
        pos = r * SEQ + i if layout == "contiguous" else torch.where(i < half, r * half + i, (2 * n - 1 - r) * half + i - half)
        kk = k.repeat_interleave(HEADS // KV_HEADS, dim=2)
        vv = v.repeat_interleave(HEADS // KV_HEADS, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / HEAD_DIM ** 0.5
        s = s.masked_fill(~(pos[:, None] >= pos[None, :]), float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)
        return out.view(BATCH, n, SEQ, HEADS, HEAD_DIM).transpose(0, 1)
    shape_q, shape_kv = (BATCH, n * SEQ, HEADS, HEAD_DIM), (BATCH, n * SEQ, KV_HEADS, HEAD_DIM)
    spec = P(None, "tp")
    return [normal(*shape_q), normal(*shape_kv), normal(*shape_kv)], (spec, spec, spec), body, reference


def _mesh(n: int):
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"world size {n} needs {n} devices, jax sees {len(devices)} (XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={n})")
    return Mesh(devices[:n], ("tp",))


def _function(case: Case, n: int, mesh, body, specs):
    """``(global inputs) -> stacked results``: ``body`` on torchax tensors inside jit(shard_map)."""
    import jax
    import torchax
    from jax import shard_map
    from jax.sharding import PartitionSpec as P

    env = torchax.default_env()

    def device(*xs):
        ts = env.j2t_iso(xs)
        with env:
            out = body(*ts)
        return env.t2j_iso(out)

    return shard_map(device, mesh=mesh, in_specs=specs, out_specs=P("tp"))


def run_case(case: Case, n: int, dtype: str, mesh=None) -> tuple[float, float, float]:
    """Execute ``case`` forward and backward on ``n`` devices in ``dtype``; (forward error, backward error, the
    reference's largest magnitude): the largest absolute differences from the reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    mesh = _mesh(n) if mesh is None else mesh
    inputs, specs, body, reference = _problem(case, n)
    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    rounded = [t.to(tdtype).to(torch.float64) for t in inputs]
    f = _function(case, n, mesh, body, specs)
    want = reference(*[t.clone().requires_grad_(True) for t in rounded])
    g = torch.Generator().manual_seed(7)
    cotangent = torch.randint(-2, 3, want.shape, generator=g).to(torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in rounded]
    want = reference(*leaves)
    want_grads = torch.autograd.grad((want * cotangent).sum(), leaves)

    args = [jnp.asarray(t.to(torch.float32).numpy(), dtype=jdtype) for t in rounded]
    ct = jnp.asarray(cotangent.to(torch.float32).numpy(), dtype=jdtype)

    def loss(*xs):
        out = f(*xs)
        return (out.astype(jnp.float32) * ct.astype(jnp.float32)).sum(), out

    (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)

    if jax.process_count() > 1:  # the results span the devices of every process: bring them here
        from jax.experimental import multihost_utils

        got = multihost_utils.process_allgather(got, tiled=True)
        grads = [multihost_utils.process_allgather(x, tiled=True) for x in grads]

    def err(a, b) -> float:
        return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - b.detach().numpy()))) if b.numel() else 0.0

    forward = err(got.astype(jnp.float32), want)
    backward = max(err(gj.astype(jnp.float32), gt) for gj, gt in zip(grads, want_grads))
    scale = max(float(want.detach().abs().max()), max(float(x.abs().max()) for x in want_grads))
    return forward, backward, scale


#: The largest error allowed, relative to the reference's largest magnitude: float32 is exact on the
#: integer-valued problems; ring attention (exp, division) and bfloat16 (8 bits of mantissa, sums rounded
#: per slice) within these.
def tolerance(case: Case, dtype: str) -> float:
    if dtype == "bfloat16":
        return 3e-2
    return 1e-5 if case.op == "ring_attention" else 0.0


# -- the HLO --------------------------------------------------------------------------------------------------------


def lowered_hlo(case: Case, n: int, mesh=None) -> str:
    """The HLO text of ``case``'s forward at ``n`` devices, lowered (not optimised): the ring sits in the
    ``shard_map`` body computation."""
    import jax
    import jax.numpy as jnp
    import torch

    mesh = _mesh(n) if mesh is None else mesh
    inputs, specs, body, _ = _problem(case, n)
    f = _function(case, n, mesh, body, specs)
    args = [jnp.asarray(t.to(torch.float32).numpy()) for t in inputs]
    return jax.jit(f).lower(*args).as_text(dialect="hlo")


def _dots(module, comp) -> list[str]:
    """The dots of ``comp``: ``dot`` instructions, and fusions or calls whose computation holds one."""
    names = []
    for name in comp.order:
        ins = comp.instructions[name]
        if ins.opcode == "dot":
            names.append(name)
        elif ins.opcode in ("fusion", "call"):
            called = (ins.attribute("calls") or ins.attribute("to_apply") or "").lstrip("%")
            inner = module.computations.get(called)
            if inner is not None and inner.of("dot"):
                names.append(name)
    return names


def check_hlo(case: Case, n: int, text: str) -> list[str]:
    """Compare the ``shard_map`` body of ``text`` with the schedule ``case`` walks; the failures, as lines.

    A ring: one collective-permute per receive of the template (N-1 per channel, times the parts), each with
    ``source_target_pairs`` equal to ``Ring(N).pairs(shift)`` of its step; on an all-gather or reduce-scatter
    ring each permute of a channel forwards what the one before it delivered; every dot of an all-gather or
    all-to-all depends on exactly the permutes up to the one that delivered its slice (so it runs while the
    next is in flight); every reduce-scatter dot depends on no permute, and the first permute that needs it is
    the one that sends its running sum in the next step. ``vanilla``/``sliced``: one whole collective per
    chunk, no permute. Ring attention is checked for its permutes and pairs only (two dots per block).
    """
    from commfuse.schedule import Collective, Ring, build, parse_algorithm
    from commfuse.testing import hlo

    module = hlo.parse(text)
    collective = Collective(case.collective)
    spec = parse_algorithm(case.algorithm, collective)
    schedule = build(collective, n, algorithm=spec.schedule_algorithm, parts=spec.parts, chunks=spec.chunks)
    whole_op = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all"}[
        case.collective]
    failures: list[str] = []
    fail = failures.append
    steps = schedule.template
    if schedule.algorithm.value in ("vanilla", "sliced"):
        want = sum(len(s.collectives) for s in steps)
        bodies = module.holding(whole_op)
        got = sum(len(c.of(whole_op)) for c in bodies)
        if module.holding("collective-permute"):
            fail(f"collective-permutes in a {schedule.algorithm} schedule")
        if got != want:
            fail(f"{got} {whole_op} ops, the schedule has {want}")
        return failures
    bodies = module.holding("collective-permute")
    if len(bodies) != 1:
        return [f"collective-permutes in {len(bodies)} computations ({[c.name for c in bodies]}), expected one "
                "shard_map body"]
    body = bodies[0]
    if body.entry:
        fail(f"the permutes sit in ENTRY ({body.name}), not in a shard_map body")
    ring = Ring(n)
    expected = [(s.index, t.channel, t.shift, t.slice) for s in steps for t in s.recvs]
    permutes = body.topological([i.name for i in body.of("collective-permute")])
    if len(permutes) != len(expected):
        return [f"{len(permutes)} collective-permutes, the schedule has {len(expected)}"]
    got_pairs = sorted(tuple(body.instructions[p].source_target_pairs) for p in permutes)
    want_pairs = sorted(tuple(ring.pairs(shift)) for _, _, shift, _ in expected)
    if got_pairs != want_pairs:
        fail(f"permute pairs {got_pairs} differ from the schedule's {want_pairs}")
    if case.op == "ring_attention":
        return failures
    # the permutes of each channel, in chain order; the schedule's, per channel, in step order
    chains: dict[int, list[str]] = collections.defaultdict(list)
    want_chain: dict[int, list[tuple]] = collections.defaultdict(list)
    for step, channel, shift, x in expected:  # a part of a shard travels on its own: one chain per part
        want_chain[(channel, x.part)].append((step, shift, x))
    forwarding = collective is not Collective.ALL_TO_ALL
    if forwarding:
        for p in permutes:
            feeds = [c for c, chain in chains.items() if chain and body.depends(p, chain[-1])]
            if len(feeds) > 1:
                fail(f"{p} depends on the permutes of channels {feeds}")
            elif feeds:
                chains[feeds[0]].append(p)
            else:
                chains[len(chains)].append(p)
        lengths = sorted(len(c) for c in chains.values())
        if lengths != sorted(len(c) for c in want_chain.values()):
            fail(f"permute chains of lengths {lengths}, the schedule's channels have "
                 f"{sorted(len(c) for c in want_chain.values())}: each hop must forward what the one before delivered")
            return failures
        # match chains to channels by their pairs (channels differ in shift where they differ at all)
        order = sorted(chains, key=lambda c: (body.instructions[chains[c][0]].source_target_pairs, c))
        worder = sorted(want_chain, key=lambda c: (ring.pairs(want_chain[c][0][1]), c))
        chains = {w: chains[c] for c, w in zip(order, worder)}
    dots = _dots(module, body)
    if collective is Collective.REDUCE_SCATTER:
        # the step in which each dot's partial (its running sum) is first sent on, by the schedule and in the HLO
        computed = {x: s.index for s in steps for x in s.compute}
        sends = [(s.index, t.slice) for s in steps for t in s.sends]

        def first_send(xs):
            found = [step for step, x in sends if x in xs and step > computed[x]]
            return min(found) if found else schedule.num_steps

        if case.op == "produce_reduce_scatter":  # the producer makes a shard's partial once, then it is cut
            groups = collections.defaultdict(list)
            for x in computed:
                groups[x.shard].append(x)
            want_steps = sorted(first_send(xs) for xs in groups.values())
        else:
            want_steps = sorted(first_send([x]) for x in computed)
        got_steps = []
        for d in dots:
            if any(body.depends(d, p) for p in permutes):
                fail(f"{d} depends on a collective-permute: a partial must need nothing received")
            users = [want_chain[c][i][0] for c, chain in chains.items() for i, p in enumerate(chain)
                     if body.depends(p, d)]
            got_steps.append(min(users) if users else schedule.num_steps)
        if len(got_steps) != len(want_steps):
            fail(f"{len(dots)} dots, the schedule computes {len(want_steps)} partials")
        elif sorted(got_steps) != want_steps:
            fail(f"the first permute sending each dot's sum is at steps {sorted(got_steps)}, the schedule says "
                 f"{want_steps}")
        return failures
    # all-gather and all-to-all: each dot waits for the permutes that delivered what it computes on, no later one
    arrival = {}
    if forwarding:
        for c, chain in chains.items():
            for i, (step, shift, x) in enumerate(want_chain[c]):
                arrival[x] = (c, i)
    else:
        for i, (step, channel, shift, x) in enumerate(expected):
            arrival[x] = (shift,)
    per_shard = case.op != "all_gather_matmul"
    groups = collections.defaultdict(list)
    for s in steps:
        for x in s.compute:
            groups[(x.source if x.source is not None else x.shard) if per_shard else (s.index, x)].append(x)

    def frontier_of(xs):
        f = {}
        for x in xs:
            where = arrival.get(x)
            if where is None:
                continue
            key, value = (where[0], where[1]) if forwarding else ("shift", where[0])
            f[key] = max(f.get(key, -1), value)
        return tuple(sorted(f.items()))

    want = sorted(frontier_of(xs) for xs in groups.values())
    got = []
    for d in dots:
        f = {}
        if any(body.depends(p, d) for p in permutes):
            fail(f"a collective-permute depends on {d}: all-gather and all-to-all hops carry received data only")
        if forwarding:
            for c, chain in chains.items():
                for i, p in enumerate(chain):
                    if body.depends(d, p):
                        f[c] = max(f.get(c, -1), i)
        else:
            for p in permutes:
                if body.depends(d, p):
                    pairs = body.instructions[p].source_target_pairs
                    shift = (pairs[0][1] - pairs[0][0]) % n
                    f["shift"] = max(f.get("shift", -1), shift)
        got.append(tuple(sorted(f.items())))
    got.sort()
    if got != want:
        fail(f"dots out of schedule order: the permutes each dot waits for are {got}, the schedule says {want}")
    return failures


# -- command line ---------------------------------------------------------------------------------------------------


def _table(world_sizes, dtypes, hlo_checks: bool, cases=CASES, label: str = "") -> int:
    failed = 0
    for n in world_sizes:
        mesh = _mesh(n)
        t0 = time.perf_counter()
        for case in cases:
            line = []
            bad = []
            for dtype in dtypes:
                fwd, bwd, scale = run_case(case, n, dtype, mesh)
                tol = tolerance(case, dtype) * scale
                ok = fwd <= tol and bwd <= tol
                line.append(f"{dtype} fwd {fwd:.3g} bwd {bwd:.3g}")
                if not ok:
                    bad.append(f"{dtype}: error above {tol:.3g} (|reference| up to {scale:.3g})")
            if hlo_checks:
                problems = check_hlo(case, n, lowered_hlo(case, n, mesh))
                line.append("hlo ok" if not problems else "hlo FAIL")
                bad += problems
            status = "ok  " if not bad else "FAIL"
            print(f"{status} {label}world {n} {str(case):36s} {'; '.join(line)}", flush=True)
            for b in bad[:4]:
                print(f"       {b}", flush=True)
            failed += bool(bad)
        print(f"-- {label}world size {n}: {len(cases)} cases in {time.perf_counter() - t0:.1f} s", flush=True)
    return failed


def _worker(process_id: int, port: int, cases) -> int:
    """One of two processes with two devices each: the cases at world size 4 across both."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    print(f"process {process_id}: {jax.local_device_count()} local devices of {jax.device_count()}", flush=True)
    return _table([4], ["float32"], False, cases, label=f"process {process_id} ")


def _two_processes(cases) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, "-m", "commfuse_jax.verify", "--worker", str(i), "--port", str(port)],
                              env=env) for i in range(2)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sum(c != 0 for c in codes)


#: What the two-process run executes (it compiles for four devices in two processes: kept short).
TWO_PROCESS_CASES = (Case("all_gather_matmul", "ring"), Case("matmul_reduce_scatter", "bidirectional"),
                     Case("all_to_all_consume", "ring"), Case("ring_attention", "ring"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m commfuse_jax.verify", description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--hlo", action="store_true", help="also check each case's lowered HLO against its schedule")
    p.add_argument("--processes", type=int, choices=[1, 2], default=1,
                   help="2: instead, run a few cases at world size 4 across two processes of two devices each")
    p.add_argument("-k", default="", help="only the cases whose name contains this")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return 1 if _worker(args.worker, args.port, TWO_PROCESS_CASES) else 0
    if args.processes == 2:
        failed = _two_processes(TWO_PROCESS_CASES)
        print(f"two processes: {2 - failed} finished clean, {failed} failed")
        return 1 if failed else 0
    cases = [c for c in CASES if args.k in str(c)]
    failed = _table(args.world_sizes, args.dtypes, args.hlo, cases)
    total = len(cases) * len(args.world_sizes)
    print(f"{total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
