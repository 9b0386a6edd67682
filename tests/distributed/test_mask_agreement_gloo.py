"""Tier (b), real gloo ranks: masks and document metadata whose content differs from rank to rank are caught on
every call. commfuse.nn.ParallelAttention's document_ids and cu_seqlens (and a boolean attn_mask under
COMMFUSE_CHECK=always), commfuse.ring_attention's document_lengths (one list, or one per row) and
commfuse.nn.RingAttention's: MismatchError on every rank naming rank 0, the rank that differs and what
differs, no rank returning a result; the next call on the same group, with equal masks, matches the unsharded
attention. The wall time from the call to the error on each rank is printed (pytest -s)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _mask_agreement_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int, *args) -> list[dict]:
    return launch(getattr(cases, body), n, *args, timeout=300)


def _check(body: str, n: int, name: str, *args) -> None:
    results = _results(body, n, *args)
    errors = {r: res.get(name, "did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    times = [res.get(f"time:{name}") for res in results]
    if all(t is not None for t in times):
        print(f"\n{body} {name}, {n} ranks: seconds from the call to MismatchError, by rank: "
              + ", ".join(f"{t:.4f}" for t in times))


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("document-ids", "cu-seqlens"))
def test_parallel_attention_masks_that_differ_raise_on_every_rank(name, n):
    _check("parallel_attention", n, name)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("document-ids", "cu-seqlens", "boolean"))
def test_parallel_attention_masks_that_differ_raise_under_check_always(name, n):
    """COMMFUSE_CHECK=always: a dense boolean attn_mask is compared too (and the rest as without it)."""
    _check("parallel_attention", n, name, "always")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("lengths", "per-row", "layer"))
def test_ring_attention_document_lengths_that_differ_raise_on_every_rank(name, n):
    _check("ring_attention", n, name)
