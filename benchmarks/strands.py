"""Two strands against one: a Llama-style block under commfuse's TP, two micro-batches forward + backward.

Tier: benchmark (prints figures, asserts nothing). Rows, side by side and interleaved per repeat, each
checked against ``ring`` (losses and every gradient):

- ``vanilla``: micro-batches one after the other, each op its library collective then its GEMM;
- ``ring``: micro-batches one after the other, each op commfuse's ring (today's commfuse);
- ``strands naive``: micro-batch 2's forward stages beside micro-batch 1's backward stages, k with k;
- ``strands searched``: the same, paired and ordered by the plan search over the stages' measured figures.

Where a slot pairs a stage with transfers and one without, the one without runs inside the other's first
commfuse op, after its transfers are posted (``commfuse.strands``). The stages' figures are measured once
on the group (compute-only and comm-only runs of each stage's forward, ``commfuse.runtime.measure``) and
the plan is computed from rank 0's, broadcast.

Run it on a shaped link (root; a private network namespace, the host's loopback untouched)::

    unshare --net sh -c 'ip link set lo up && tc qdisc add dev lo root tbf rate 700mbit burst 350000 \\
        latency 400ms && python benchmarks/strands.py'
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))


def body(rank: int, n: int, sizes: dict, repeats: int) -> dict:
    import _strands_cases as cases

    from commfuse import strands
    from commfuse.runtime import measure

    torch.set_num_threads(1)
    cases.HIDDEN, cases.HEADS, cases.FFN = sizes["hidden"], sizes["heads"], sizes["ffn"]
    cases.SEQ, cases.BATCH = sizes["seq"], sizes["batch"]
    params = {k: v.requires_grad_() for k, v in cases._params(rank, n).items()}
    batches = cases._batches(rank, n, 2, 0)

    def stages(algorithm: str, figures: dict | None = None):
        out = cases._stages(params, algorithm, False)
        if figures is None:
            return out
        return [strands.Stage(s.name, s.fn, figures[s.name][0], figures[s.name][1]) for s in out]

    # the stages' figures: each stage's forward in compute-only and comm-only runs, on micro-batch 0's inputs
    figures = {}
    h = (batches[0][0],)
    for stage in stages("ring"):
        times = {}
        for mode in ("compute_only", "comm_only"):
            samples = []
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                with torch.no_grad(), measure(mode):
                    stage.fn(*h)
                samples.append(time.perf_counter() - t0)
            times[mode] = statistics.median(samples)
        with torch.no_grad():
            out = stage.fn(*h)
        h = out if isinstance(out, tuple) else (out,)
        has_comm = stage.name != "attention core"
        figures[stage.name] = (times["compute_only"], times["comm_only"] if has_comm else 0.0)
    shared = [figures]
    dist.broadcast_object_list(shared)  # rank 0's figures: one plan on every rank
    figures = shared[0]

    rows = {"vanilla": ("vanilla", "sequential"), "ring": ("ring", "sequential"),
            "strands naive": ("ring", "alternate"), "strands searched": ("ring", "searched")}
    wall = {name: [] for name in rows}
    results = {}
    for rep in range(repeats + 1):
        for name, (algorithm, plan) in rows.items():
            for p in params.values():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            losses = strands.run(stages(algorithm, figures), batches, cases._loss, plan=plan)
            dist.barrier()
            if rep:
                wall[name].append(time.perf_counter() - t0)
            else:
                results[name] = [torch.stack(losses)] + [p.grad.clone() for p in params.values()]
    ok = {name: all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, results["ring"]))
          for name, got in results.items()}
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in wall.items()}, "ok": ok, "figures": figures,
            "order": strands.order(stages("ring", figures), micro_batches=2, plan="searched")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from commfuse.launch import launch

    sizes = {k: getattr(args, k) for k in ("hidden", "heads", "ffn", "seq", "batch")}
    res = launch(body, 2, sizes, args.repeats, timeout=1800)[0]
    figs = res["figures"]
    compute = sum(c for c, _ in figs.values())
    comm = sum(m for _, m in figs.values())
    print(f"Llama-style block, TP 2 with SP, {sizes}; two micro-batches, forward + backward; median of "
          f"{args.repeats}")
    print("stage figures (forward, ms): " + ", ".join(f"{k} {1e3 * c:.1f}/{1e3 * m:.1f}" for k, (c, m) in figs.items()))
    print(f"forward comm-only / compute-only: {comm / compute:.2f}")
    base = res["ms"]["ring"]
    for name, ms in res["ms"].items():
        print(f"  {name:<18} {ms:9.1f} ms  {base / ms:5.2f}x ring  {'ok' if res['ok'][name] else 'WRONG'}")
    print("searched order: " + " ".join(f"{k}{i}.{s}" for k, i, s in res["order"]))


if __name__ == "__main__":
    main()
