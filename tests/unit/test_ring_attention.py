"""Tier (a), no processes: the sequence layouts of context parallelism (commfuse.context), the log-sum-exp
merge and the block plans of ring attention, its single-process reference against float64 SDPA at world sizes
1 to 16 (the error does not grow with the ring), and the op's forward and backward at world size 1."""

from __future__ import annotations

import pytest
import torch

import commfuse as cf
from commfuse.context import chunks_of, positions, rope, shard_sequence, unshard_sequence
from commfuse.errors import CommfuseError
from commfuse.fused.attention import attend
from commfuse.fused import ring_attention as ring_attention_module
from commfuse.fused.ring_attention import block_attention, block_plans, merge_lse, ring_attention_reference


def _same_document(lengths):
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:, None] == ids[None, :]


def _reference(q, k, v, causal, lengths=None):
    """Attention of the whole sequence, masked to documents: one list for every batch row, or one per row."""
    mask = None
    if lengths is not None:
        if isinstance(lengths[0], int):
            mask = _same_document(lengths)[None, None]
        else:
            mask = torch.stack([_same_document(row) for row in lengths])[:, None]
    return attend(q, k, v, causal=causal, mask=mask)


@pytest.mark.parametrize("layout", ("contiguous", "zigzag"))
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_shard_and_unshard_round_trip_and_positions(n, layout):
    seq = 4 * n
    x = torch.arange(2 * seq * 3).view(2, seq, 3)
    shards = [shard_sequence(x, r, n, layout) for r in range(n)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    y = x.transpose(0, 1)  # the sequence at dim 0
    assert torch.equal(unshard_sequence([shard_sequence(y, r, n, layout, dim=0) for r in range(n)], layout, dim=0),
                       y)
    for r in range(n):
        assert torch.equal(shards[r][0, :, 0] // 3, positions(seq, r, n, layout))  # row i holds position pos[i]
    assert sorted(torch.cat([positions(seq, r, n, layout) for r in range(n)]).tolist()) == list(range(seq))


def test_zigzag_holds_chunks_r_and_2n_minus_1_minus_r():
    assert positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert chunks_of(12, 1, 3, "zigzag") == [(2, 4), (8, 10)]


def test_layouts_refuse_what_does_not_cut():
    with pytest.raises(CommfuseError, match=r"rank 1: a sequence of 6 positions does not cut into 4 equal chunks"):
        chunks_of(6, 1, 2, "zigzag")
    with pytest.raises(CommfuseError, match="'striped'"):
        positions(8, 0, 2, "striped")
    with pytest.raises(CommfuseError, match="rank 2 is not a rank of a world of size 2"):
        positions(8, 2, 2)


def test_rope_by_positions_equals_the_llama_blocks_rope():
    from commfuse.models.llama import apply_rope, rope_cache

    q, k = torch.randn(2, 6, 3, 8), torch.randn(2, 6, 1, 8)
    want_q, want_k = apply_rope(q, k, rope_cache(8, 6))
    pos = torch.arange(6)
    torch.testing.assert_close(rope(q, pos), want_q)
    torch.testing.assert_close(rope(k, pos), want_k)


def test_merge_of_two_key_sets_equals_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query: 2 K/V heads for 4 query heads
    scale = 8**-0.5
    whole, _ = block_attention(q, k, v, scale)
    o1, l1 = block_attention(q, k[:, :2], v[:, :2], scale)
    o2, l2 = block_attention(q, k[:, 2:], v[:, 2:], scale)
    for a, b in (((o1, l1), (o2, l2)), ((o2, l2), (o1, l1))):
        merged, _ = merge_lse(*a, *b)
        torch.testing.assert_close(merged, whole)
    torch.testing.assert_close(whole, _reference(q, k, v, False))
    empty = (torch.zeros_like(o1), torch.full_like(l1, float("-inf")))  # no keys: merges as nothing
    merged, lse = merge_lse(*empty, o1, l1)
    assert torch.equal(merged, o1) and torch.equal(lse, l1)
    masked, masked_lse = block_attention(q, k, v, scale, torch.zeros(5, 5, dtype=torch.bool))
    assert torch.isinf(masked_lse).all() and not masked.isnan().any()


def test_blocks_are_merged_in_float32_for_bfloat16_inputs():
    q, k = torch.randn(1, 4, 2, 8).bfloat16(), torch.randn(1, 4, 2, 8).bfloat16()
    o, lse = block_attention(q, k, k, 0.3)
    assert o.dtype == lse.dtype == torch.float32


def test_causal_block_plans_skip_masked_blocks_and_zigzag_balances_every_step():
    n, seq = 4, 32
    contiguous = [block_plans(seq, r, n, "contiguous", True) for r in range(n)]
    for r, plans in enumerate(contiguous):
        assert [p is None for p in plans] == [s > r for s in range(n)]  # the blocks above the diagonal: skipped
        assert plans[r].mask is not None and all(plans[s].mask is None for s in range(r))
    zigzag = [block_plans(seq, r, n, "zigzag", True) for r in range(n)]
    for step in range(n):  # the ring's step k: rank r computes on source r - k
        work = {(p.r1 - p.r0) * (p.c1 - p.c0) for r in range(n) for p in [zigzag[r][(r - step) % n]]}
        assert work == ({(seq // n) ** 2} if step == 0 else {(seq // n) ** 2 // 2}), (step, work)
    assert all(p is not None and p.mask is None for p in block_plans(seq, 1, n, "zigzag", False))


@pytest.mark.parametrize("layout", ("contiguous", "zigzag"))
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_reference_ring_equals_unsharded_attention(n, layout):
    g = torch.Generator().manual_seed(n)
    seq = 4 * n
    for causal in (True, False):
        for hkv, lengths in ((4, None), (2, [1, seq - 3, 2])):
            q = torch.randn(2, seq, 4, 8, generator=g, dtype=torch.float64)
            k, v = (torch.randn(2, seq, hkv, 8, generator=g, dtype=torch.float64) for _ in range(2))
            cut = [[shard_sequence(t, r, n, layout) for r in range(n)] for t in (q, k, v)]
            got = unshard_sequence(ring_attention_reference(*cut, causal=causal, layout=layout,
                                                            document_lengths=lengths), layout)
            torch.testing.assert_close(got, _reference(q, k, v, causal, lengths))


@pytest.mark.parametrize("layout", ("contiguous", "zigzag"))
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_per_row_documents_equal_attention_masked_row_by_row(n, layout):
    """Packed rows whose documents differ (one list of lengths per batch row, as lists, 1-D tensors or a 2-D
    tensor): the ring equals each row's own document mask. A block that one row needs and another does not is
    computed for both, the other masked."""
    g = torch.Generator().manual_seed(10 + n)
    seq = 8 * n
    rows = [[3, seq - 5, 2], [seq], [1] * seq, [seq // 2, seq - seq // 2]]
    for causal in (True, False):
        q = torch.randn(4, seq, 4, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(4, seq, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        cut = [[shard_sequence(t, r, n, layout) for r in range(n)] for t in (q, k, v)]
        got = unshard_sequence(ring_attention_reference(*cut, causal=causal, layout=layout,
                                                        document_lengths=rows), layout)
        torch.testing.assert_close(got, _reference(q, k, v, causal, rows))
        as_tensors = [torch.tensor(row) for row in rows]
        again = unshard_sequence(ring_attention_reference(*cut, causal=causal, layout=layout,
                                                          document_lengths=as_tensors), layout)
        assert torch.equal(again, got)
    # rows of equal document counts as one 2-D tensor, against the same lists
    two = [[seq // 2, seq - seq // 2], [1, seq - 1]]
    cut2 = [[shard_sequence(t[:2], r, n, layout) for r in range(n)] for t in (q, k, v)]
    from_tensor = ring_attention_reference(*cut2, causal=True, layout=layout, document_lengths=torch.tensor(two))
    from_lists = ring_attention_reference(*cut2, causal=True, layout=layout, document_lengths=two)
    assert all(torch.equal(a, b) for a, b in zip(from_tensor, from_lists))
    torch.testing.assert_close(unshard_sequence(from_lists, layout), _reference(q[:2], k[:2], v[:2], True, two))


@pytest.mark.parametrize("kernel", (True, False), ids=("cpu-flash-kernel", "einsum-blocks"))
def test_per_row_documents_forward_and_backward_at_world_size_one(kernel, monkeypatch):
    """Both block paths: the CPU's flash kernel, and the float32 einsums that every other device runs (taken
    here by hiding the kernel)."""
    if not kernel:
        monkeypatch.setattr(ring_attention_module, "_CPU_KERNEL", None)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 8, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for causal, rows in ((True, [[3, 5], [1, 1, 6]]), (False, [[3, 5], [1, 1, 6]]), (True, [2, 6]), (True, None)):
        got = cf.ring_attention(q, k, v, causal=causal, document_lengths=rows)
        want = _reference(q, k, v, causal, rows)
        torch.testing.assert_close(got, want)
        dout = torch.randn(got.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
            torch.testing.assert_close(a, b)
    if not kernel:  # and the ring's blocks at 3 ranks, per-row documents, zigzag
        seq, n = 12, 3
        q3, k3, v3 = (torch.randn(2, seq, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        rows = [[5, 7], [1, 4, 7]]
        cut = [[shard_sequence(t, r, n, "zigzag") for r in range(n)] for t in (q3, k3, v3)]
        got = unshard_sequence(ring_attention_reference(*cut, causal=True, layout="zigzag",
                                                        document_lengths=rows), "zigzag")
        torch.testing.assert_close(got, _reference(q3, k3, v3, True, rows))


@pytest.mark.parametrize("lengths,words", (
    ([[3, 5]], ("1 rows of lengths", "batch has 2 rows")),
    ([[3, 5], [3, 4]], ("document_lengths[1] sum to 7", "8 positions")),
    ([[3, 5], [8, 0]], ("document_lengths[1][1] = 0",)),
    ([[3, 5], 8], ("document_lengths[1] = 8", "one list of ints per batch row")),
    (torch.ones(2, 2, 2, dtype=torch.int64), ("integer lengths", "[2, 2, 2]")),
))
def test_per_row_documents_refused_by_name(lengths, words):
    q = torch.randn(2, 8, 4, 8)
    k = torch.randn(2, 8, 2, 8)
    with pytest.raises(CommfuseError) as e:
        cf.ring_attention(q, k, k, document_lengths=lengths)
    assert all(w in str(e.value) for w in ("rank 0", *words)), str(e.value)


@pytest.mark.parametrize("dtype,bound", ((torch.float32, 32 * 2.0**-23), (torch.bfloat16, 2 * 2.0**-8 + 2e-3)))
def test_reference_ring_error_does_not_grow_with_the_world_size(dtype, bound):
    """The merge is in float32 whatever the inputs: the error against float64 at 8 and 16 ranks stays within
    4x the error at 2 and within ``bound`` (float32: 32 ulps at 1; bfloat16: the output's rounding)."""
    errors = {}
    for n in (2, 8, 16):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 64, 2, 8, generator=g, dtype=torch.float64).to(dtype).double() for _ in range(3))
        cut = [[shard_sequence(t, r, n, "zigzag").to(dtype) for r in range(n)] for t in (q, k, v)]
        got = unshard_sequence(ring_attention_reference(*cut, causal=True, layout="zigzag"), "zigzag")
        errors[n] = (got.double() - _reference(q, k, v, True)).abs().max().item()
    assert max(errors[8], errors[16]) <= max(4 * errors[2], bound), errors
    assert max(errors.values()) <= bound, errors


@pytest.mark.parametrize("causal", (True, False))
def test_world_size_one_forward_and_backward_equal_attention(causal):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 8, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = cf.ring_attention(q, k, v, causal=causal, document_lengths=[3, 5])
    want = _reference(q, k, v, causal, [3, 5])
    torch.testing.assert_close(got, want)
    dout = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b)


def test_auto_halves_ring_attentions_rings_on_two_ranks_only():
    """ring attention asks resolve_call for halves: its K/V and dK/dV rings take ring:2 on two ranks (each slice
    attended to as it arrives), while half a block still carries the smallest hop auto takes a ring for."""
    from commfuse.planning.calls import MIN_SLICE_BYTES, _halved
    from commfuse.schedule import Collective

    for collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        assert _halved(collective, 2, 4 * MIN_SLICE_BYTES, None, "ring", "why")[0] == "ring:2"
        assert _halved(collective, 3, 4 * MIN_SLICE_BYTES, None, "ring", "why")[0] == "ring"
        assert _halved(collective, 2, MIN_SLICE_BYTES, None, "ring", "why")[0] == "ring"  # half is under the bar
        assert _halved(collective, 2, 4 * MIN_SLICE_BYTES, None, "vanilla", "why")[0] == "vanilla"


def test_slice_plans_cover_the_block_plan_and_bound_it_tighter():
    """Each slice of a source's keys has its own plan: the slices' allowed pairs are exactly the block's, and
    the slices' computed boxes are never larger than the block's, smaller on zigzag's diagonal."""
    from commfuse.fused.ring_attention import _SlicePlans

    seq, n = 32, 2
    for layout in ("contiguous", "zigzag"):
        for r in range(n):
            plans = _SlicePlans(seq, r, n, layout, True, None, None)
            length = seq // n
            for s in range(n):
                whole = plans.whole[s]
                want = torch.zeros(length, length, dtype=torch.bool)
                if whole is not None:
                    want[whole.r0:whole.r1, whole.c0:whole.c1] = True if whole.mask is None else whole.mask
                got = torch.zeros_like(want)
                for start in range(0, length, 4):
                    p = plans(s, start, 4)
                    if p is None:
                        continue
                    got[p.r0:p.r1, start + p.c0:start + p.c1] = True if p.mask is None else p.mask
                assert torch.equal(got, want), (layout, r, s)
            # what is computed: the slices' boxes never exceed the block's, and on zigzag's diagonal they are
            # smaller (a key slice of the later chunk is seen by that chunk's queries only)
            def area(p):
                return 0 if p is None else (p.r1 - p.r0) * (p.c1 - p.c0)

            for s in range(n):
                sliced = sum(area(plans(s, start, 4)) for start in range(0, length, 4))
                assert sliced <= area(plans.whole[s]), (layout, r, s)
                if layout == "zigzag" and s == r:
                    assert sliced < area(plans.whole[s]), (layout, r)
