"""The algorithm grammar and the shard layout: said once, here, for ops, bench, sim and lowerings.

``algorithm`` is written ``name[:N]``:

=================  ===========================================================
``auto``           the ops choose (``commfuse.planning.calls``)
``ring[:m]``       CommFuse: N - 1 point-to-point hops, each paired with one
                   shard's compute; ``m`` slices per shard (the paper's m)
``bidirectional``  the ring with half of every slice going each way round
``serial[:m]``     the ring's hops and compute, with no overlap: each step
                   waits for its transfers before it computes (a baseline
                   that isolates the collective from the overlap)
``sliced[:c]``     data slicing: ``c`` whole collectives (default 2)
``vanilla``        one whole collective, then all the compute
``native``         the backend's own fused kernel for the whole op (torch
                   symmetric memory on CUDA, MC2 on Ascend), where the
                   backend declares one and the call qualifies; the fused
                   matmul ops only
=================  ===========================================================

Shards follow ``torch.tensor_split``: a dim of ``length`` over ``n`` ranks
gives the first ``length % n`` ranks one more row (:func:`split_sizes`).
Pure Python; imports no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.schedule._ir import Algorithm, Collective

#: Every name the grammar knows, in the order the docs list them.
ALGORITHM_NAMES = ("auto", "ring", "bidirectional", "serial", "sliced", "vanilla", "native")
#: Names whose ``:N`` is the number of slices per shard (the rest: ``sliced``'s chunks; none for others).
_PARTED = ("ring", "bidirectional", "serial")
#: The largest ``:N`` the grammar reads: no tensor has more rows than an int64 counts, so no shard has more
#: slices and no collective more chunks.
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class AlgorithmSpec:
    """One parsed ``algorithm`` string."""

    name: str  #: one of :data:`ALGORITHM_NAMES`
    parts: int = 1  #: slices per shard (ring, bidirectional, serial)
    chunks: int = 1  #: whole collectives (sliced)

    @property
    def schedule_algorithm(self) -> str:
        """The schedule this runs: ``serial`` walks the ring's schedule."""
        return "ring" if self.name == "serial" else self.name

    @property
    def overlap(self) -> bool:
        """Whether a step's compute runs while its transfers fly (all but ``serial``)."""
        return self.name != "serial"

    @property
    def shown(self) -> str:
        """As a user writes it: ``ring``, ``ring:2``, ``sliced`` (2 chunks), ``sliced:4``."""
        if self.name == "sliced":
            return self.name if self.chunks == 2 else f"{self.name}:{self.chunks}"
        return self.name if self.parts == 1 else f"{self.name}:{self.parts}"


@functools.lru_cache(maxsize=512)
def _parse(text: str, collective: Collective | None) -> AlgorithmSpec:
    name, colon, count = text.partition(":")
    if name not in ALGORITHM_NAMES:
        raise CommfuseValueError(
            f"unknown algorithm {text!r}; expected one of {', '.join(ALGORITHM_NAMES)} (optionally ':N')"
        )
    if collective is not None and collective.blocks and name == "bidirectional":
        raise CommfuseValueError(f"algorithm 'bidirectional' is not defined for {collective}; it has ring, serial, "
                                 "sliced, vanilla")
    k = 0
    if colon:
        # ASCII digits only: str.isdigit also takes '٢' and '²' (int() reads the first as 2 and fails on the
        # second); an empty count is an error, not "no count"
        digits = count.isascii() and count.isdigit()
        if not digits or name in ("auto", "vanilla", "native"):
            raise CommfuseValueError(
                f"bad algorithm {text!r}: only {', '.join(_PARTED)} and sliced take ':N', N written in the digits "
                "0-9 and >= 1"
            )
        # past MAX_COUNT's digits it is too big; and int() refuses 4300+ digits
        k = int(count) if len(count.lstrip("0")) <= len(str(MAX_COUNT)) else MAX_COUNT + 1
        if not 1 <= k <= MAX_COUNT:
            raise CommfuseValueError(f"bad algorithm {text!r}: N must be from 1 to {MAX_COUNT}")
    if name == "sliced":
        return AlgorithmSpec(name, 1, k or 2)
    return AlgorithmSpec(name, k or 1, 1)


def parse_algorithm(algorithm: str | Algorithm, collective: Collective | str | None = None) -> AlgorithmSpec:
    """``"ring:2"`` -> ``AlgorithmSpec("ring", parts=2)``; ``"sliced"`` -> ``("sliced", chunks=2)``.

    ``collective`` (when given) refuses what it does not define, such as a
    bidirectional all-to-all. Raises ``CommfuseValueError`` naming the text.
    """
    text = algorithm.value if isinstance(algorithm, Algorithm) else algorithm
    if not isinstance(text, str):
        raise CommfuseTypeError(f"algorithm must be a string such as 'ring' or 'sliced:4', got {algorithm!r}")
    if isinstance(collective, str):
        collective = Collective(collective)
    return _parse(text, collective)


def site_algorithm(who: str, algorithm, *collectives: Collective | str, native: bool = False):
    """``algorithm`` checked for every collective a layer or style runs it on, when the layer or style is
    built (a misspelt ``"rign"`` is named there, not at the first forward); returned as given. ``native`` (a
    backend's own fused kernel) is allowed where the site's ops are ``all_gather_matmul`` and
    ``matmul_reduce_scatter`` only. Errors are prefixed with ``who``."""
    try:
        for collective in collectives:
            spec = parse_algorithm(algorithm, collective)
    except (CommfuseTypeError, CommfuseValueError) as e:  # "unknown algorithm 'rign'; expected one of ..."
        raise type(e)(f"{who}: {e}") from None
    if spec.name == "native" and not native:
        raise CommfuseValueError(
            f"{who}: algorithm 'native' (a backend's own fused kernel) exists for all_gather_matmul and "
            "matmul_reduce_scatter only, and this runs other ops too; give auto, ring, bidirectional, serial, "
            "sliced or vanilla"
        )
    return algorithm


def split_sizes(length: int, n: int) -> list[int]:
    """Sizes of ``torch.tensor_split(x, n)`` along a dim of ``length``."""
    base, extra = divmod(length, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of ``sizes`` starts when they are laid end to end."""
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out
