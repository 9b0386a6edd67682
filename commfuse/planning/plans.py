"""The plan entries of one call signature, kept in the planning table: schedule, compiled steps, plan.

:func:`schedule_for` and :func:`compiled_for` keep what ``commfuse.schedule`` built and
``runtime.compiled`` made, once per algorithm and world size and once per rank; :func:`new_plan` makes
the runtime's :class:`~commfuse.runtime.compiled.Plan` of a call from them, and :func:`kept_plan` and :func:`keep_plan` keep
a signature's ``(plan, layout, pool, ...)`` entry, which claims its layout's receive buffers in the pool.
:class:`SignaturePlan` is that entry as the callers who keep it hold it. The collectives' modules above
(``planning.gather``, ``planning.scatter``, ``planning.all_to_all``) say what goes into an entry.
"""

from __future__ import annotations


from commfuse.planning import table
from commfuse.planning.calls import Call
from commfuse.runtime.compiled import Compiled, Plan
from commfuse.runtime.programs import BufferPool
from commfuse.schedule import AlgorithmSpec, Collective, Schedule, build

__all__ = ["SignaturePlan", "compiled_for", "keep_plan", "kept_plan", "new_plan", "schedule_for"]


def schedule_for(collective: Collective, world_size: int, spec: AlgorithmSpec) -> Schedule:
    """The schedule an algorithm runs at a world size, built once and kept in the planning table."""
    key = ("schedule", collective, world_size, spec.schedule_algorithm, spec.parts, spec.chunks)
    return table.find(key, build, collective.value, world_size, algorithm=spec.schedule_algorithm,
                      parts=spec.parts, chunks=spec.chunks)


def compiled_for(schedule: Schedule, rank: int) -> Compiled:
    """One rank's compiled steps of a schedule, made once and kept in the planning table."""
    return table.find(("compiled", schedule, rank), Compiled, schedule, rank)


def new_plan(call: Call, collective: Collective, label: str) -> Plan:
    """The runtime's plan of ``call`` for ``collective``, on the schedule and compiled steps kept for it."""
    spec = call.spec
    schedule = schedule_for(collective, call.be.world_size, spec)
    return Plan(schedule, call.be, label=label, timeout=call.timeout, check=call.check, overlap=spec.overlap,
                compiled=compiled_for(schedule, call.be.rank))


def kept_plan(key: tuple) -> tuple | None:
    """The (plan, layout, pool, ...) kept in the planning table for ``key``, or None: the caller makes it then,
    and keeps it with :func:`keep_plan`."""
    return table.kept(("plan", *key))


def keep_plan(key: tuple, value: tuple) -> tuple:
    """Keep the (plan, layout or None, pool, ...) made for ``key``: the entry holds the plan (its calls mark it
    used) and claims its layout's receive buffers in the pool (an uneven all-to-all's, whose layout is made per
    call, are never pooled). Returns what is kept (another thread's, if it kept one first)."""
    return table.keep(("plan", *key), value, **_held(value))


def _held(value: tuple) -> dict:
    """What a plan entry ``(plan, layout or None, pool, ...)`` holds, as ``table.remember`` takes it."""
    plan, layout, pool = value[0], value[1], value[2]
    return {"plan": plan, "pool": pool, "keys": () if layout is None else layout.pool_keys()}


class SignaturePlan:
    """What ``gather.prepare_gather`` or ``scatter.prepare_scatter`` found for one call signature: the runtime's
    ``plan``, the program's ``layout``, the backend's receive-buffer ``pool`` and the ``dim`` the shards
    are cut along. Callers keep it and run calls on it with no look-up."""

    __slots__ = ("plan", "layout", "pool", "dim")

    def __init__(self, plan: Plan, layout, pool: BufferPool, dim: int) -> None:
        self.plan, self.layout, self.pool, self.dim = plan, layout, pool, dim
