"""The step table: one row per step, one column per rank.

A cell lists what the rank does in that step, in execution order:

``S(x)->p``  send slice x to rank p (posted at the start of the step)
``R(x)<-p``  receive slice x from rank p (lands at the end of the step)
``AG[j]`` / ``RS[j]`` / ``A2A[j]``  a whole collective on chunk j
``C(x)``     compute on slice x (reduce-scatter: compute the partial of x;
             produce-all-to-all: compute block x, which a later step sends)
``+(x)``     add the running sum received this step into the partial of x

A slice is written ``shard``, then ``.part`` when shards have several parts
and ``a``/``b`` (forward/backward ring) for ``bidirectional``; an all-to-all
block is ``source>destination``.
"""

from __future__ import annotations

from commfuse.schedule._ir import Collective, Schedule, SliceId, Step

_CALL = {Collective.ALL_GATHER: "AG", Collective.REDUCE_SCATTER: "RS", Collective.ALL_TO_ALL: "A2A"}


def _cell(schedule: Schedule, step: Step) -> str:
    def lab(x: SliceId) -> str:
        return x.label(schedule.splits, schedule.halves)

    words = [f"S({lab(t.slice)})->{t.peer}" for t in step.sends]
    words += [f"R({lab(t.slice)})<-{t.peer}" for t in step.recvs]
    words += [f"{_CALL[c.collective]}[{c.part}]" for c in step.collectives]
    if step.compute:
        words.append("C(" + ",".join(lab(x) for x in step.compute) + ")")
    if step.accumulate:
        words.append("+(" + ",".join(lab(x) for x in step.accumulate) + ")")
    return " ".join(words) if words else "-"


def render(schedule: Schedule) -> str:
    """The schedule as a plain-text table (the format of the ``schedules/`` catalog)."""
    n = schedule.world_size
    columns = [[_cell(schedule, step) for step in schedule.steps(r)] for r in range(n)]
    header = ["step"] + [f"rank {r}" for r in range(n)]
    rows = [[str(i)] + [columns[r][i] for r in range(n)] for i in range(schedule.num_steps)]
    widths = [max(len(row[c]) for row in [header] + rows) for c in range(n + 1)]

    def line(cells: list[str]) -> str:
        return " | ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()

    out = [f"# {schedule.describe()}", line(header), "-+-".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    return "\n".join(out) + "\n"
