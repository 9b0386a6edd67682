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


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("middle-ring", "middle-ring:2", "middle-bidirectional", "middle-vanilla"))
def test_ring_attention_one_middle_rank_that_differs_is_named_on_every_rank(name, n):
    """Only rank 1 differs: on 3 ranks the ring's digest pairs tell rank 0 through rank 2's flag, under every
    algorithm (vanilla's whole collective carries no pair: an exchange after the call compares)."""
    _check("ring_attention", n, name)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("body", ("ring_attention", "parallel_attention"))
def test_compared_masks_make_no_call_of_their_own(body, n):
    """On gloo the masks' digest rides the op's own transfers: an op with masks makes as many numbered calls as
    one without."""
    _check(body, n, "rides")


@pytest.mark.parametrize("n", (2, 3))
def test_ring_attention_one_rank_failing_while_the_digest_rides_leaves_the_group_usable(n):
    """The last rank fails in its first block: it raises its own error, every other rank PeerFailedError naming
    it or a right result, and the next call with equal lengths is right (the call drained with its digest
    pairs)."""
    _check("ring_attention", n, "fails")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("tp-document-ids", "tp-cu-seqlens", "tp-rides"))
def test_attention_parallel_masks_that_differ_raise_on_every_rank(name, n):
    """commfuse.tp.AttentionParallel compares its masks as ParallelAttention does, its digest riding the
    attention's reduce-scatter."""
    _check("attention_parallel", n, name)


@pytest.mark.parametrize("n", (2, 3))
def test_attention_parallel_boolean_masks_that_differ_raise_under_check_always(n):
    _check("attention_parallel", n, "tp-boolean", "always")


@pytest.mark.parametrize("algorithm", ("ring", "vanilla"))
def test_two_dimensional_ulysses_groups_that_differ_raise_on_every_rank(algorithm):
    """cp 2 x ulysses 2: each cp group agrees within itself and the Ulysses groups do not; every rank raises
    MismatchError naming the Ulysses group (its exchanges carry the digest, or an exchange of its own under a
    whole all-to-all)."""
    _check("two_dimensional", 4, "two-d", algorithm)
