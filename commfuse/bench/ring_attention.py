"""``commfuse bench -w ring_attention``: causal grouped-query attention under context parallelism, forward +
backward, every row of ``config.RING_ATTENTION_ROWS`` side by side (``workloads.RingAttentionRows`` builds them).

What every rank runs:

1. every row once, checked (the ops' fingerprint exchange on) against the unsharded attention of the whole
   sequence: the output and dq, dk, dv shards within the dtype's tolerance (``workloads.TOLERANCE``);
2. each measure mode tried once on each row on commfuse's ops: a mode a row fails in (on any rank) is left out
   of its timing and reported with the error;
3. ``--warmup`` untimed and ``--repeats`` timed repeats, in each of which every row runs once, and every row
   built on commfuse's ops (ring attention, Ulysses) three times more, under ``measure("compute_only")``,
   ``measure("comm_only")`` and ``measure("outside_only")``, in an order shuffled anew every repeat (the same on
   every rank); torch's rows run their own collectives, which the measure modes cannot remove, so they are
   timed in the normal mode only. Every run starts behind a barrier; each rank's own time is kept, so that the
   report can take a repeat's figure as the slowest rank's and compare the ranks' compute-only times (the
   zigzag layout's load balance);
4. every row once more for its peak memory (:func:`commfuse.bench.memory.peak_memory`), the largest over the
   ranks.

Rows this installation cannot run (``commfuse.ring_attention`` missing, torch's ring on another device) are
reported with the reason and never timed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commfuse.bench.config import RING_ATTENTION_ROWS, BenchConfig
from commfuse.bench.shared import fingerprint_exchange, gather_objects, peak_per_row, timed_rounds
from commfuse.bench.workloads import RingAttentionRows, compare
from commfuse.errors import first_line
from commfuse.runtime import measure

#: the measure modes a row on commfuse's ops is timed in besides the normal run: its compute alone, its transfers
#: (and the code around the ops) alone, and the code around the ops alone
MODES = ("compute_only", "comm_only", "outside_only")


def measured(row: str) -> bool:
    """Whether the row's collectives are commfuse's, which the measure modes can take apart."""
    return RING_ATTENTION_ROWS[row][0] != "torch"


def units(config: BenchConfig) -> int:
    """Progress units of the workload: each row's check and memory run, every timed run."""
    rows = list(RING_ATTENTION_ROWS)
    runs = sum(1 + (len(MODES) if measured(row) else 0) for row in rows)
    return 2 + 2 * len(rows) + runs * (config.warmup + config.repeats)  # 2: the reference, the modes' probe


def run_workload(workload: RingAttentionRows, config: BenchConfig, dev: torch.device, bar, sync) -> list[dict]:
    """The workload's one record (rank 0's; every figure gathered from every rank)."""
    n = dist.get_world_size()
    rows = [row for row in workload.rows if row not in workload.missing]
    bar.note(f"commfuse bench: ring_attention on {n} ranks, {len(rows)} rows, {config.repeats} repeats")
    ref = workload.reference()
    bar.advance("ring_attention: reference")

    # correctness (and a first warm-up): every row against the unsharded attention, checked calls
    checked = {}
    for row in rows:
        with fingerprint_exchange(True):
            got = workload.step(row)
        sync()
        checked[row] = compare(got, workload.expected(row, ref))
        bar.advance(f"ring_attention {row}: checked")
    del ref, got
    every = gather_objects(checked, n, dev)
    correct = {row: all(c[row][0] for c in every) for row in rows}
    worst = {row: max(c[row][1] for c in every) for row in rows}

    # which measure modes each row on commfuse's ops survives (an op whose backward needs what its forward's
    # compute left behind may fail with the compute removed): the same on every rank, the others' reasons kept
    unmeasured: dict[str, dict[str, str]] = {}
    for row in rows:
        for mode in MODES if measured(row) else ():
            try:
                with measure(mode), fingerprint_exchange(config.fingerprint):
                    workload.step(row)
                sync()
                why = ""
            except Exception as e:  # noqa: BLE001 - reported in the table; every rank fails alike
                why = first_line(e, 200, named=True)
            for theirs in gather_objects(why, n, dev):
                if theirs:
                    unmeasured.setdefault(row, {}).setdefault(mode, theirs)
            dist.barrier()
    bar.advance("ring_attention: measure modes probed")

    # the timed loop: every row, and the rows on commfuse's ops in the three measure modes, shuffled every repeat
    items = [(row, None) for row in rows] + [(row, mode) for row in rows if measured(row) for mode in MODES
                                             if mode not in unmeasured.get(row, {})]
    def advance(text: str) -> None:
        bar.advance(f"ring_attention {text}")

    walls = gather_objects(timed_rounds(config, items, workload.step, sync, advance), n, dev)  # [rank][repeat][item]

    # peak memory: every row once more, warm
    peaks, how = peak_per_row(config, rows, workload.step, sync, dev, advance)
    peak_bytes = dict(zip(rows, peaks))

    return [{
        "kind": "ring_attention",
        "workload": "ring_attention",
        "rows": list(workload.rows),
        "missing": dict(workload.missing),
        "stock_context_parallel": workload.stock,
        "unmeasured": unmeasured,  # row -> {mode: why it failed there}
        "algorithms": [],  # no per-algorithm traces: trace and plot skip it
        "traces": {},
        "items": [[row, mode] for row, mode in items],
        "wall_s": walls,  # [rank][repeat][item], each rank's own time
        "correct": correct,
        "max_rel_error": worst,
        "peak_bytes": peak_bytes,
        "peak_how": how,
    }]
