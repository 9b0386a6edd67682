"""Spans: the ``(start, size, tensor)`` pieces of a tensor along one dim that a step computes on.

:func:`gather_spans <commfuse.planning.gather.gather_spans>` hands them to its consumer and
:func:`scatter_spans <commfuse.planning.scatter.scatter_spans>` asks its producer for them; the ops,
their backward passes and the layers read and write the rows they cover with these helpers. Plain
torch: no plan, call or runtime.
"""

from __future__ import annotations

import torch

__all__ = ["consecutive", "join", "matmul_rows", "rows_of", "write_rows"]


def join(spans, dim: int, pick=lambda span: span[2]) -> torch.Tensor:
    """The spans' tensors concatenated along ``dim`` (no copy for one span)."""
    return pick(spans[0]) if len(spans) == 1 else torch.cat([pick(span) for span in spans], dim=dim)


def consecutive(spans) -> bool:
    return all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def rows_of(t: torch.Tensor, spans, dim: int) -> torch.Tensor:
    """The rows of ``t`` along ``dim`` that ``spans`` cover, in span order."""
    if len(spans) == 1 or consecutive(spans):
        return t.narrow(dim, spans[0][0], sum(span[1] for span in spans))
    return torch.cat([t.narrow(dim, span[0], span[1]) for span in spans], dim=dim)


def write_rows(out: torch.Tensor, spans, dim: int, value: torch.Tensor) -> None:
    """Write ``value`` (the spans' rows, concatenated along ``dim``) into ``out``."""
    if len(spans) == 1 or consecutive(spans):
        out.narrow(dim, spans[0][0], value.shape[dim]).copy_(value)
        return
    for (start, size, *_), part in zip(spans, torch.split(value, [span[1] for span in spans], dim=dim)):
        out.narrow(dim, start, size).copy_(part)


def matmul_rows(out: torch.Tensor, spans, dim: int, a: torch.Tensor, b: torch.Tensor, direct: bool = False) -> None:
    """``out[rows of spans] = a @ b``, straight into ``out`` when the rows are one contiguous block
    (``direct``: the caller knows every block of rows along ``dim`` of ``out`` is contiguous)."""
    if len(spans) == 1 or consecutive(spans):
        region = out.narrow(dim, spans[0][0], a.shape[dim])
        if direct or region.is_contiguous():
            torch.matmul(a, b, out=region)
            return
    write_rows(out, spans, dim, torch.matmul(a, b))
