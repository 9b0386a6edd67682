"""How much of a schedule's communication its compute hid: one definition for the bench, the simulator and
the conformance suite. Pure Python."""

from __future__ import annotations

__all__ = ["hidden_fraction"]


def hidden_fraction(total: float, compute: float, comm: float) -> float:
    """The share of what could be hidden that was: ``(compute + comm - total) / min(compute, comm)``, clipped to
    [0, 1]; 1 when either side takes no time (nothing to hide).

    ``compute`` and ``comm`` are the run with its transfers removed and with its compute removed, ``total`` the
    normal run, all without the work outside the fused ops. The numerator is the time the overlap saved over
    running the two back to back; at most the shorter side can hide behind the longer, so perfect overlap scores
    1 whichever side dominates, and running the two back to back scores 0. Where comm <= compute it is
    ``1 - exposed / comm`` (docs/benchmarks.md, "The hidden fraction").
    """
    hideable = min(compute, comm)
    if hideable <= 0:
        return 1.0
    return max(0.0, min(1.0, (compute + comm - total) / hideable))
