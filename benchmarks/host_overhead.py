"""Host cost per call of commfuse's ops against the floor: a minimal hand-written Python ring.

Tier: benchmark (prints figures, asserts nothing). torch's ``fake`` process
group makes this one process rank 0 of N: every send, receive and collective
completes at once without moving data, so what is timed is the Python and
torch dispatch an op costs on the host, which on a GPU decides whether the
host can keep the device busy. Tensors are tiny so the matmuls cost next to
nothing.

Rows, per world size (median over rounds of the mean per call):
- ``floor ring``: per step one ``batch_isend_irecv`` (send to r+1, receive
  from r-1) and one matmul into the output's rows; no checks, no timeouts;
- ``floor reduce-scatter``: per step one matmul, one add, one
  ``batch_isend_irecv``;
- ``torch collective``: ``all_gather_single`` (or ``reduce_scatter_single``;
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before torch 2.13)
  then the matmul;
- commfuse's ``ring``, ``vanilla`` and ``auto`` for ``all_gather_matmul``
  and ``matmul_reduce_scatter``;
- the two rings' forwards on inputs that want gradients (a training step's
  forward: the op's autograd Function runs the forward planned for the
  signature), with no target: they add autograd's own cost.

Design targets: ring and reduce-scatter ring at most 1.3x the floor at
n=2 and n=8; vanilla at most 20 us over torch's collective plus matmul;
``auto`` at most 5 us over the algorithm it picks.

``--consume``: rows for the ops that take a Python callable, ring, in the
same shuffled rounds: ``all_gather_consume`` and ``all_to_all_consume``
(each shard's consumer one matmul), ``produce_reduce_scatter`` with
``inputs`` (each partial one matmul) and ``ring_attention`` (causal, 2
heads, 4 positions a rank; and with two documents, ``document_lengths``).
They have no floor row of their own; they are for comparing one tree's
per-call cost with another's.

``--walks``: whether the walks could be one loop. One ring all-gather signature, planned once, each slice's
consumer one matmul into the output's rows, walked two ways in the same rounds: ``walk with a program``
(``runtime.walks.execute``, the loop a call with gradients, a first call and an observed call take: a
``GatherProgram`` holds the call's data and the loop calls its methods per step) and ``walk without a program``
(``execute_one_by_one``, the repeated no-gradient ring call: steps resolved once into records, buffers from the
pool's free lists). Their difference is what folding the two loops into the program's would cost every
repeated ring call.

``--recorder``: the flight recorder's cost (``commfuse.runtime.recorder``).
The ring and vanilla rows run again on one more group of the same ranks,
passed by name, whose recorder is as ``COMMFUSE_RECORDER`` says (on, 64
calls, by default), after the shuffled rounds and apart from them: per row,
``--pairs`` pairs of blocks of ``--pair-calls`` calls, one block with the
recorder on the group's plans and one with it taken off the same plans,
which of the two runs first alternating from pair to pair. The recorder's
cost is the median over the pairs of on less off, printed with the
quartiles of those differences and against its target, +1 us per call.
(Pairing blocks back to back matters: with the on and off rows as two more
candidates of the shuffled rounds, each round's two figures lay up to 20
candidates apart and the difference moved by up to 1 us between runs.)
The fake group's waits return at once, so, as on a stream-ordered device,
the recorder takes no per-step stamps here: what is timed is its per-call
record.

``--dtype`` (float32, bfloat16 or float16): every row's tensors, the floor's
and torch's too; a reduce-scatter of half partials sums them in float32 (the
floor and torch's rows do not).

    python benchmarks/host_overhead.py [--world-sizes 2 8] [--rounds 15] [--calls 200] [--recorder]
        [--pairs 200] [--pair-calls 100] [--consume] [--walks] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _floor_ring(a, w, out, bufs, n):
    m = a.shape[0]
    cur = a
    for k in range(n):
        if k < n - 1:
            nxt = bufs[k % 2]
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, (0 + 1) % n),
                                            dist.P2POp(dist.irecv, nxt, (0 - 1) % n)])
        src = (0 - k) % n
        torch.matmul(cur, w, out=out[src * m:(src + 1) * m])
        if k < n - 1:
            for work in works:
                work.wait()
            cur = nxt
    return out


def _floor_rs(x, w, bufs, n):
    m = x.shape[0] // n
    acc = None
    works = []  # the previous step's transfers
    for k in range(n):
        dest = (0 - 1 - k) % n
        part = torch.matmul(x[dest * m:(dest + 1) * m], w)
        if acc is not None:
            for work in works:
                work.wait()
            part.add_(bufs[(k - 1) % 2])
        if k < n - 1:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, part, (0 + 1) % n),
                                            dist.P2POp(dist.irecv, bufs[k % 2], (0 - 1) % n)])
        acc = part
    return acc


def _per_call_us(candidates: dict, calls: int, rounds: int) -> dict[str, float]:
    """Median over rounds of the mean us per call of each candidate; every round times every candidate,
    in an order shuffled per round, so that load from elsewhere falls on all of them alike."""
    import random

    for fn in candidates.values():
        for _ in range(20):
            fn()
    samples: dict = {name: [] for name in candidates}
    order = list(candidates)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn = candidates[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def _paired(fn, plans, rec, pairs: int, calls: int) -> tuple[float, float, list[float]]:
    """``fn`` timed in ``pairs`` pairs of blocks of ``calls`` calls, one block with ``rec`` on ``plans`` and
    one without, the first of each pair alternating: the median us per call on and off, and each pair's on
    less off."""
    clock = time.perf_counter_ns
    on_us, off_us, diffs = [], [], []
    for k in range(pairs):
        t = {}
        for on in ((True, False) if k % 2 else (False, True)):
            value = rec if on else None
            for plan in plans:
                plan.recorder = value
            t0 = clock()
            for _ in range(calls):
                fn()
            t[on] = (clock() - t0) / calls / 1e3
        on_us.append(t[True])
        off_us.append(t[False])
        diffs.append(t[True] - t[False])
    for plan in plans:
        plan.recorder = rec
    return statistics.median(on_us), statistics.median(off_us), diffs


def walk_pair(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, m: int, n: int) -> dict:
    """``--walks``' two rows: one ring all-gather signature of ``a`` (``m`` rows a rank), planned once, each
    slice's consumer a matmul by ``w`` into its rows of ``out``, walked with a program and without. Checks
    once, by profiling a call of each, that each takes the loop its row names."""
    from commfuse.planning.calls import resolve_call
    from commfuse.planning.gather import prepare_gather, run_gather
    from commfuse.runtime import walks as _walks
    from commfuse.schedule import Collective

    call = resolve_call(Collective.ALL_GATHER, "ring", device=a.device, check=False,
                        slice_bytes=a.numel() * a.element_size())
    planned = prepare_gather(call, a.shape, a.dtype, 0, (m,) * n, "host_overhead.walks", [])

    def into_rows(spans):
        for start, size, t in spans:
            torch.matmul(t, w, out=out[start:start + size])

    def into_rows_one(start, size, t):
        torch.matmul(t, w, out=out[start:start + size])

    rows = {"walk with a program": lambda: run_gather(planned, a, into_rows),
            # run_gather takes the walk without a program once the plan is settled
            "walk without a program": lambda: run_gather(planned, a, into_rows, consume_one=into_rows_one)}
    run_gather(planned, a, into_rows)  # the signature's first call: settles the plan
    ran: list = []
    for (row, fn), loop in zip(rows.items(), (_walks._walk, _walks.execute_one_by_one)):
        sys.setprofile(lambda frame, event, _arg: event == "call" and ran.append(frame.f_code))
        try:
            fn()
        finally:
            sys.setprofile(None)
        if loop.__code__ not in ran:
            raise SystemExit(f"--walks: {row} did not run {loop.__name__}")
        ran.clear()
    return rows


def measure(n: int, calls: int, rounds: int, recorder: bool = False, pairs: int = 200,
            pair_calls: int = 100, consume: bool = False, dtype: torch.dtype = torch.float32,
            walks: bool = False) -> dict:
    import commfuse as cf
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        m, k, f = 4, 8, 8
        a = torch.randn(m, k, dtype=dtype)
        w = torch.randn(k, f, dtype=dtype)
        out = torch.empty(n * m, f, dtype=dtype)
        bufs = [torch.empty_like(a), torch.empty_like(a)]
        x = torch.randn(n * m, k, dtype=dtype)
        rs_bufs = [torch.empty(m, f, dtype=dtype), torch.empty(m, f, dtype=dtype)]
        gathered = torch.empty(n * m, k, dtype=dtype)
        rs_out = torch.empty(m, f, dtype=dtype)
        candidates = {}

        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def torch_ag():
            gather_single(gathered, a)
            return torch.matmul(gathered, w)

        def torch_rs():
            scatter_single(rs_out, torch.matmul(x, w))
            return rs_out

        candidates["floor ring"] = lambda: _floor_ring(a, w, out, bufs, n)
        candidates["floor reduce-scatter"] = lambda: _floor_rs(x, w, rs_bufs, n)
        candidates["torch all_gather+mm"] = torch_ag
        candidates["torch mm+reduce_scatter"] = torch_rs
        for alg in ("ring", "vanilla", "auto"):
            candidates[f"cf ag {alg}"] = lambda alg=alg: cf.all_gather_matmul(a, w, algorithm=alg, check=False)
            candidates[f"cf rs {alg}"] = lambda alg=alg: cf.matmul_reduce_scatter(x, w, algorithm=alg, check=False)
        a_g, x_g, w_g = (t.clone().requires_grad_() for t in (a, x, w))

        def ag_grad():
            with torch.enable_grad():
                return cf.all_gather_matmul(a_g, w_g, algorithm="ring", check=False)

        def rs_grad():
            with torch.enable_grad():
                return cf.matmul_reduce_scatter(x_g, w_g, algorithm="ring", check=False)

        candidates["cf ag ring, with grads"] = ag_grad
        candidates["cf rs ring, with grads"] = rs_grad
        if consume:
            chunks = list(x.view(n, m, k).unbind(0))
            q, kv = torch.randn(1, 4, 2, 8, dtype=dtype), torch.randn(1, 4, 2, 8, dtype=dtype)
            # ring_attention takes no check argument, and the fake group's receives carry no fingerprints
            os.environ["COMMFUSE_CHECK"] = "0"

            def gemm(t, source):
                return torch.matmul(t, w)

            def partial(dest, x, w):
                return torch.matmul(x[dest * m:(dest + 1) * m], w)

            candidates["cf ag consume ring"] = lambda: cf.all_gather_consume(a, gemm, algorithm="ring", check=False)
            candidates["cf a2a consume ring"] = lambda: cf.all_to_all_consume(chunks, gemm, algorithm="ring",
                                                                              check=False)
            candidates["cf produce rs ring"] = lambda: cf.produce_reduce_scatter(partial, inputs=(x, w),
                                                                                 algorithm="ring", check=False)
            candidates["cf ring attention"] = lambda: cf.ring_attention(q, kv, kv, algorithm="ring")
            # with documents (their digest is made on every call unless COMMFUSE_CHECK=0, as set above; the fake
            # group exchanges none, its receives carry nothing: benchmarks/mask_agreement.py times the exchange)
            halves = [2 * n, 2 * n]
            candidates["cf ring attention, documents"] = lambda: cf.ring_attention(q, kv, kv, algorithm="ring",
                                                                                    document_lengths=halves)
        if walks:
            candidates.update(walk_pair(a, w, out, m, n))
        if recorder:
            # One more group, passed by name, whose plans run with their recorder and without it (_paired sets
            # it on the plans before each block), so on and off run the same plan objects, the same group, the
            # same path. (Two groups, one made with COMMFUSE_RECORDER=0, were tried first: between two such
            # groups with the recorder off on both, the rows differed by up to 0.8 us, more than the recorder's
            # own cost.)
            import gc

            from commfuse.runtime.compiled import Plan

            own = dist.new_group(list(range(n)))
            for alg in ("ring", "vanilla"):
                cf.all_gather_matmul(a, w, algorithm=alg, check=False, group=own)
                cf.matmul_reduce_scatter(x, w, algorithm=alg, check=False, group=own)
            plans = [o for o in gc.get_objects() if isinstance(o, Plan) and o.state.group is own]
            rec = plans[0].recorder if plans else None
            if rec is None:
                raise SystemExit("--recorder: the recorder is off (COMMFUSE_RECORDER=0)")

            recorded = {}
            for alg in ("ring", "vanilla"):
                recorded[f"ag {alg}"] = lambda alg=alg: cf.all_gather_matmul(a, w, algorithm=alg, check=False,
                                                                             group=own)
                recorded[f"rs {alg}"] = lambda alg=alg: cf.matmul_reduce_scatter(x, w, algorithm=alg, check=False,
                                                                                group=own)
        with torch.no_grad():
            rows: dict = _per_call_us(candidates, calls, rounds)
        if recorder:
            with torch.no_grad():
                for row, fn in recorded.items():
                    on, off, diffs = _paired(fn, plans, rec, pairs, pair_calls)
                    rows[f"cf {row} recorder on"], rows[f"cf {row} recorder off"] = on, off
                    rows[f"{row} recorder extra"] = diffs
        report: dict = {}
        cf.all_gather_matmul(a, w, algorithm="auto", check=False, report=report)
        rows["auto ag picks"] = report["algorithm"]
        report = {}
        cf.matmul_reduce_scatter(x, w, algorithm="auto", check=False, report=report)
        rows["auto rs picks"] = report["algorithm"]
        return rows
    finally:
        from commfuse.backends import release

        release()
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--recorder", action="store_true",
                   help="also time the commfuse rows on a group with the flight recorder off (see the module)")
    p.add_argument("--pairs", type=int, default=200, help="--recorder: pairs of on and off blocks per row")
    p.add_argument("--pair-calls", type=int, default=100, help="--recorder: calls per block")
    p.add_argument("--consume", action="store_true",
                   help="also time all_gather_consume, all_to_all_consume, produce_reduce_scatter, ring_attention")
    p.add_argument("--walks", action="store_true",
                   help="one ring signature walked with a program and without")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"host us per call, fake process group, rank 0 of N, median of {args.rounds} rounds x {args.calls} calls, "
          f"{args.dtype}")
    for n in args.world_sizes:
        r = measure(n, args.calls, args.rounds, args.recorder, args.pairs, args.pair_calls, args.consume,
                    getattr(torch, args.dtype), args.walks)
        print(f"\nworld size {n}")
        for name, value in r.items():
            if name.endswith("recorder extra"):
                continue  # printed against its target below
            print(f"  {name:26s} {value:9.1f}" if isinstance(value, float) else f"  {name:26s} {value:>9s}")
        ring_ratio = r["cf ag ring"] / r["floor ring"]
        rs_ratio = r["cf rs ring"] / r["floor reduce-scatter"]
        ag_van = r["cf ag vanilla"] - r["torch all_gather+mm"]
        rs_van = r["cf rs vanilla"] - r["torch mm+reduce_scatter"]
        ag_auto = r["cf ag auto"] - r[f"cf ag {r['auto ag picks'].split(':')[0]}"]
        rs_auto = r["cf rs auto"] - r[f"cf rs {r['auto rs picks'].split(':')[0]}"]
        print(f"  ring / floor ring              {ring_ratio:5.2f}x  (target <= 1.3x) {'met' if ring_ratio <= 1.3 else 'MISSED'}")
        print(f"  rs ring / floor reduce-scatter {rs_ratio:5.2f}x  (target <= 1.3x) {'met' if rs_ratio <= 1.3 else 'MISSED'}")
        for what, extra, limit in (("ag vanilla over torch", ag_van, 20), ("rs vanilla over torch", rs_van, 20),
                                   ("ag auto over its pick", ag_auto, 5), ("rs auto over its pick", rs_auto, 5)):
            print(f"  {what:30s} {extra:+6.1f} us (target <= {limit} us) {'met' if extra <= limit else 'MISSED'}")
        if args.walks:
            with_, without = r["walk with a program"], r["walk without a program"]
            print(f"  walk with a program / without  {with_ / without:5.2f}x  ({with_ - without:+.1f} us a call: what "
                  "one loop over the program would add to a repeated ring call)")
        if args.recorder:
            for row in ("ag ring", "rs ring", "ag vanilla", "rs vanilla"):
                diffs = r[f"{row} recorder extra"]
                extra = statistics.median(diffs)
                q1, _, q3 = statistics.quantiles(diffs, n=4)
                print(f"  {row + ' recorder on - off':30s} {extra:+6.2f} us (target <= 1 us) "
                      f"{'met' if extra <= 1 else 'MISSED'}; quartiles of {len(diffs)} pairs {q1:+.2f} to {q3:+.2f}")


if __name__ == "__main__":
    main()
