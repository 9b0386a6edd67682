"""Derived calls: a resolved :class:`~commfuse.planning.calls.Call` made into the call a plan is made for.

Two derivations, each remembered per (call, what it adds) in the planning table, so that a layer that
derives on every forward pays a dict look-up and the plans keyed by the derived call are made once:

* :func:`configured` adds a layer's options (:func:`layer_config`), which every op run with the call adds
  to its fingerprint (:func:`config_of`);
* :func:`capped` lowers ``ring:m``-like algorithms to at most one slice per row of the smallest shard.

Named for the one job: a call in, a call out. It knows no plan, layout or program; the modules that make
plans (``planning.gather``, ``planning.scatter``, ``planning.all_to_all``) call it first.
"""

from __future__ import annotations

import logging

from commfuse.planning import table
from commfuse.planning.calls import Call
from commfuse.runtime.fingerprints import config_values
from commfuse.schedule import AlgorithmSpec

__all__ = ["capped", "config_of", "configured", "layer_config"]

log = logging.getLogger("commfuse")


class _Configured(Call):
    """A :class:`Call` that carries a layer's options (``config``: the integers :func:`configured` adds to the
    fingerprint of every op run with it)."""

    __slots__ = ("config",)

    def __init__(self, be, spec: AlgorithmSpec, timeout: float, check: str, reason: str = "asked for",
                 config: tuple[int, ...] = ()) -> None:
        super().__init__(be, spec, timeout, check, reason)
        self.config = config


def _derive(call: Call, spec: AlgorithmSpec, reason: str) -> Call:
    """``call`` with another algorithm (its backend, timeout, check and layer options kept)."""
    config = getattr(call, "config", None)
    if config is None:
        return Call(call.be, spec, call.timeout, call.check, reason)
    return _Configured(call.be, spec, call.timeout, call.check, reason, config)


def layer_config(layer: str, **options) -> tuple:
    """A layer's options that every rank must share, as the hashable value :func:`configured` and the ops'
    ``config=`` take: the options that change what the ranks compute or send but not the shapes that the
    fingerprint already compares (a causal mask, a bias, how many heads a width is cut into). Values are
    bools, ints, floats (compared by their bits) or strings (by their CRC-32; ``fingerprints.config_words`` lets a
    rank read another rank's back by name)."""
    return (layer, tuple(options.items()))


def configured(call: Call | None, config: tuple | None) -> Call | None:
    """``call`` carrying a layer's options (:func:`layer_config`): every op run with it adds them to its
    fingerprint, which the ranks compare on the first call of each signature, so a rank whose layer was built
    with other options is named on every rank (``MismatchError``, the options in words) before anything is
    sent. Remembered per (call, options): a layer that configures on every forward pays a dict look-up, and
    its plans are made once."""
    if call is None or config is None:
        return call
    key = ("derived", call, config)
    found = table.kept(key)
    if found is None:
        values = config_values(config[0], config[1])
        found = table.keep(key, _Configured(call.be, call.spec, call.timeout, call.check, call.reason,
                                            getattr(call, "config", ()) + values))
    return found


def config_of(call: Call) -> list[int]:
    """The layer options ``call`` adds to a fingerprint (none for a plain call)."""
    return list(getattr(call, "config", ()))


def capped(call: Call, rows: int, label: str) -> Call:
    """``call`` with no more slices per shard than the smallest shard has rows along the dim.

    ``ring:m``, ``serial:m`` and ``bidirectional:m`` (m parts of two halves
    each) cut every shard into slices of ``torch.tensor_split`` sizes; past
    one row per slice the rest are empty, and each still costs a step
    (``ring:10000`` on 4-row shards: 10000 slices, seconds per call). So m is
    capped at what gives every slice at least one row (never below 1: a
    one-row shard under ``bidirectional`` keeps an empty half). ``rows`` is the
    smallest shard of the tensor_split layout, the same on every rank, so
    every rank caps alike. Said once per (call, cap) at WARNING on the
    ``commfuse`` logger; the ops' ``report=`` shows the algorithm taken. Every
    plan is made through this (``planning.gather``, ``planning.scatter``,
    ``planning.all_to_all``), except an uneven all-to-all's, whose blocks change per
    call and whose empty slices cost no transfer. ``sliced:c`` (the
    data-slicing baseline, one whole collective per chunk) runs as asked.
    """
    spec = call.spec
    parts = spec.parts
    if parts == 1:
        return call
    halves = 2 if spec.name == "bidirectional" else 1
    most = max(1, rows // halves)
    if parts <= most:
        return call
    key = ("derived", call, "capped", most)  # one object per derivation: the plans keyed by it are made once
    found = table.kept(key)
    if found is None:
        new = AlgorithmSpec(spec.name, most, spec.chunks)
        cut = f"{parts} slices" if halves == 1 else f"{parts} parts of {halves} halves"
        why = (f"algorithm {spec.shown!r} would cut shards of {rows} rows (the smallest shard of the layout) into "
               f"{cut}, {'some' if parts * halves < 2 * rows else 'most'} of them empty: capped to {new.shown!r} "
               "(at least one row per slice), alike on every rank")
        log.warning("rank %d: %s: %s", call.rank, label, why)
        found = table.keep(key, _derive(call, new, f"{call.reason}; {why}"))
    return found
