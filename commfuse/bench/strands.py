"""``commfuse bench -w strands``: two micro-batches of a block, forward + backward, one after the other and as
two strands (``commfuse.strands``), per block of ``workloads.STRAND_BLOCKS``.

What every rank runs, per block:

1. the stages' forward figures, measured on the group (:func:`commfuse.strands.profile`: compute-only and
   comm-only runs of each stage, rank 0's figures on every rank), and from them the simulator's prediction
   of every row (``commfuse.sim._strands.predict_step``: each stage's backward twice its forward's compute
   and once its comm, as ``commfuse.strands`` assumes);
2. every row of ``config.STRAND_ROWS`` once, checked against ``ring`` (the losses and every parameter's
   gradient within the dtype's tolerance, ``workloads.TOLERANCE``);
3. ``--warmup`` untimed and ``--repeats`` timed repeats, in each of which every row runs once and ``ring``
   three times more, under ``measure("compute_only")``, ``measure("comm_only")`` and
   ``measure("outside_only")`` (the regime: its transfers alone, comm-only less outside-only, over its
   compute-only time), in an order shuffled anew every repeat (the same on every rank);
   every run starts behind a barrier, and an iteration's figure is the slowest rank's;
4. every row once more for its peak memory (:func:`commfuse.bench.memory.peak_memory`), the largest over
   the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commfuse.bench.config import STRAND_ROWS, BenchConfig
from commfuse.bench.shared import fingerprint_exchange, peak_per_row, timed_rounds
from commfuse.bench.workloads import StrandBlock, TwoStrands, compare

#: ``ring`` timed again under these, for the regime: its transfers alone (comm-only less outside-only, the
#: code around the ops, which comm-only runs too: the attention core, norms, weight-gradient GEMMs) over its
#: compute (compute-only)
REGIME_MODES = ("compute_only", "comm_only", "outside_only")


def units(config: BenchConfig, blocks: int) -> int:
    """Progress units of the workload: per block the profile, each row's check and memory run, every timed run."""
    rows = len(STRAND_ROWS)
    return blocks * (1 + 2 * rows + (rows + len(REGIME_MODES)) * (config.warmup + config.repeats))


def _reduced(values: list[float], op, dev: torch.device) -> list[float]:
    """``values`` reduced over the ranks by ``op`` (on ``dev``, where the group's collectives take tensors)."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()


def predictions(stages: list) -> dict:
    """The simulator's seconds for every row and the limit, from the stages' measured forward figures."""
    from commfuse import strands
    from commfuse.sim import _strands as planning

    step = planning.predict_step(*strands._profiles(stages))
    return {"vanilla": step.vanilla, "ring": step.per_op, "strands naive": step.strands(step.naive),
            "strands searched": step.strands(step.searched), "limit": step.limit,
            "searched plan": step.searched.lines()}


def run_block(workload: TwoStrands, block: StrandBlock, config: BenchConfig, dev: torch.device, bar, sync) -> dict:
    """One block's figures (rank 0's result, the same on every rank where they were reduced)."""
    from commfuse.strands import order, profile

    n = dist.get_world_size()
    rows = list(STRAND_ROWS)
    with fingerprint_exchange(config.fingerprint):
        profiled = profile(block.stages("ring"), block.batches[0][0])
    figures = {s.name: (s.compute, s.comm) for s in profiled}
    predicted = predictions(profiled)
    stages = {row: block.stages(STRAND_ROWS[row][0], figures) for row in rows}
    bar.advance(f"strands {block.name}: profiled")

    # correctness (and a first warm-up): every row against ring, checked calls
    results = {}
    for row in rows:
        results[row] = [t.detach().clone() for t in workload.step(block, stages[row], STRAND_ROWS[row][1])]
        sync()
        bar.advance(f"strands {block.name} {row}: checked")
    checked = [compare(results[row], results["ring"]) for row in rows]
    del results
    good = _reduced([1.0 if ok else 0.0 for ok, _ in checked], dist.ReduceOp.MIN, dev)
    worst = _reduced([err for _, err in checked], dist.ReduceOp.MAX, dev)

    # the timed loop: every row, and ring in the two measure modes, shuffled every repeat
    items = [(row, None) for row in rows] + [("ring", mode) for mode in REGIME_MODES]
    def step(row: str):
        return workload.step(block, stages[row], STRAND_ROWS[row][1])

    def advance(text: str) -> None:
        bar.advance(f"strands {block.name} {text}")

    wall = timed_rounds(config, items, step, sync, advance)
    wall = [_reduced(times, dist.ReduceOp.MAX, dev) for times in wall]

    # peak memory: every row once more, warm (the ring's buffer pools already built)
    peak_bytes, how = peak_per_row(config, rows, step, sync, dev, advance)

    return {
        "kind": "strands",
        "workload": "strands",
        "block": block.name,
        "what": block.what,
        "rows": rows,
        "algorithms": [],  # no per-algorithm traces: trace and plot skip it
        "traces": {},
        "items": [[row, mode] for row, mode in items],
        "wall_s": wall,  # [repeat][item], the slowest rank's
        "correct": [v >= 1.0 for v in good],
        "max_rel_error": worst,
        "peak_bytes": peak_bytes,
        "peak_how": how,
        "figures": {name: list(f) for name, f in figures.items()},
        "predicted_s": {k: v for k, v in predicted.items() if k != "searched plan"},
        "searched_plan": predicted["searched plan"],
        "searched_order": [f"{kind}{i}.{k}" for kind, i, k in
                           order(stages["strands searched"], micro_batches=2, plan="searched")],
    }


def run_workload(workload: TwoStrands, config: BenchConfig, dev: torch.device, bar, sync) -> list[dict]:
    """Every block of the workload (a block whose builder is missing: a record that says so)."""
    out = []
    for block in workload.blocks:
        if block.skipped:
            out.append({"kind": "strands", "workload": "strands", "block": block.name, "what": block.what,
                        "skipped": block.skipped, "algorithms": [], "traces": {}})
            bar.advance(n=units(config, 1))
            continue
        bar.note(f"commfuse bench: strands, {block.name}: {len(STRAND_ROWS)} rows, {config.repeats} repeats")
        out.append(run_block(workload, block, config, dev, bar, sync))
    return out
