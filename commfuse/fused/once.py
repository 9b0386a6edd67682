"""One signature of a fused op planned once: :func:`plan_once` runs the op's planner, keeps what it planned in
the planning table, and, when the planning fails on this rank, still numbers the call on the group
(:func:`note_failed`), so that the peers waiting on this rank in that call are told why. The ops
(``commfuse.ops``, ``commfuse.library``) and the attention blocks hand their planner and its arguments down to
it; nothing here calls back up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from commfuse import backends
from commfuse.planning import table
from commfuse.runtime import sites
from commfuse.runtime.admission import announce_left
from commfuse.runtime.groups import group_state, state_of_group

__all__ = ["note_failed", "plan_once"]


def plan_once(key, label: str, group, backend, make: Callable[..., Any], /, *args, **kwargs):
    """``make(*args, **kwargs)`` (a planner: validate, resolve, plan one signature), kept in the planning table
    under ``key`` (None: not kept), as long as the plans it runs (``plans``, a field of the fused matmul ops'
    plan classes) are kept. The caller hands the planner and its arguments down (no function of its own to be
    called back). A call whose planning fails still takes its call number on ``group`` (:func:`note_failed`,
    which names ``label``)."""
    try:
        run = make(*args, **kwargs)
    except BaseException as e:
        note_failed(group, backend, e, label)
        raise
    if key is None:
        return run
    run = table.remember(key, run, follows=getattr(run, "plans", ()))
    sites.planned()  # every site watches its next forward: those that find this entry say what it takes
    return run


def note_failed(group, backend, error: BaseException, label: str) -> None:
    """A call failed on this rank before it reached the executor (its validation, its policy, a producer it
    called first): it still takes its call number on the group, the failure goes on the group's board for
    the peers that wait on this rank in that call (they say why, instead of waiting out the timeout), and
    the group's next call is checked, so it cannot pair with the peers' copy of this call."""
    try:
        if backend is not None and not isinstance(backend, str):
            state = group_state(backend)
        else:
            import torch.distributed as dist

            if group is None and not (dist.is_available() and dist.is_initialized()):
                return
            pg = backends.process_group(group) if group is not None else dist.group.WORLD
            if isinstance(pg, dist.ProcessGroup) and pg not in dist.distributed_c10d._world.pg_map:
                return  # a destroyed group: nothing more to count on it
            state = state_of_group(pg)
            if state.rank is None and isinstance(pg, dist.ProcessGroup):
                state.rank, state.world_size = dist.get_rank(pg), dist.get_world_size(pg)
    except Exception:  # noqa: BLE001 - the caller's own error is what matters
        return
    announce_left(state, label, error)
