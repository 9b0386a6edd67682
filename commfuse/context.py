"""Sequence layouts of context parallelism: which tokens of the sequence each rank holds.

Context parallelism (CP) cuts the sequence over the ranks of a group; ring attention
(``commfuse.ring_attention``) then passes K/V shards around the ring. Two layouts:

============ ============================================== ==========================================
layout       rank r of N holds                              why
============ ============================================== ==========================================
contiguous   positions ``r*L .. (r+1)*L`` (L = s / N)       the plain cut; with a causal mask rank r
                                                            has r + 1 blocks of work, rank 0 one
zigzag       chunks r and 2N-1-r of 2N equal chunks         every rank has equal causal work in every
                                                            ring step (torch's load-balanced CP, the
                                                            "head-tail" or round-robin layout)
============ ============================================== ==========================================

A rank's shard is its chunks concatenated in position order, so a shard's rows are its
:func:`positions` in order. The functions here are pure tensor indexing (no communication):
:func:`shard_sequence` cuts a whole sequence, :func:`unshard_sequence` joins every rank's shard
back, :func:`positions` gives the global positions of a rank's tokens (what RoPE needs), and
:func:`rope` rotates q/k by those positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError

__all__ = ["LAYOUTS", "chunks_of", "check_layout", "positions", "rope", "shard_sequence", "unshard_sequence"]

#: the layouts a sequence can be sharded in
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else a ``CommfuseValueError`` naming it."""
    if layout not in LAYOUTS:
        raise CommfuseValueError(f"layout {layout!r} is not a sequence layout; give one of {', '.join(LAYOUTS)}")
    return layout


def _check_world(rank, world_size) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise CommfuseTypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise CommfuseValueError(f"rank {rank} is not a rank of a world of size {world_size}")


def chunks_of(seq_len: int, rank: int, world_size: int, layout: str) -> list[tuple[int, int]]:
    """The ``(start, stop)`` ranges of global positions rank ``rank`` holds, in position order.

    The sequence must divide into equal shards: ``world_size`` of them (contiguous), ``2 * world_size``
    chunks (zigzag); anything else is refused naming the length, the world size and the layout."""
    check_layout(layout)
    _check_world(rank, world_size)
    pieces = world_size if layout == "contiguous" else 2 * world_size
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0 or seq_len % pieces:
        raise CommfuseValueError(
            f"rank {rank}: a sequence of {seq_len} positions does not cut into {pieces} equal chunks "
            f"(layout {layout!r}, world size {world_size}); pad it to a multiple of {pieces}"
        )
    c = seq_len // pieces
    if layout == "contiguous":
        return [(rank * c, (rank + 1) * c)]
    tail = 2 * world_size - 1 - rank
    return [(rank * c, (rank + 1) * c), (tail * c, (tail + 1) * c)]


def positions(seq_len: int, rank: int, world_size: int, layout: str = "contiguous", *,
              device=None) -> torch.Tensor:
    """The global positions (int64, in shard order) of the tokens rank ``rank`` holds of a sequence of
    ``seq_len``: what RoPE rotates by and what the attention's masks compare."""
    ranges = chunks_of(seq_len, rank, world_size, layout)
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous",
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole sequence ``x`` along ``dim`` (its chunks in position order)."""
    if not isinstance(x, torch.Tensor):
        raise CommfuseTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    ranges = chunks_of(x.shape[dim], rank, world_size, layout)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]``, as :func:`shard_sequence` cut it)."""
    check_layout(layout)
    if isinstance(shards, torch.Tensor) or not shards:
        raise CommfuseTypeError("shards must be a non-empty list of tensors, one per rank")
    n = len(shards)
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    halves = [s.chunk(2, dim=dim) for s in shards]
    for r, s in enumerate(shards):
        if s.shape[dim] % 2:
            raise CommfuseValueError(f"shards[{r}] has {s.shape[dim]} positions along dim {dim}: a zigzag shard "
                                     "holds two equal chunks")
    return torch.cat([halves[r][0] for r in range(n)] + [halves[r][1] for r in reversed(range(n))], dim=dim)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """``x`` (batch, seq, heads, head_dim) rotated by the global positions ``pos`` (seq,) (the rotate-half
    form of Llama: each half of a head's features pairs with the other half), in float32, cast back."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = pos.to(device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)
