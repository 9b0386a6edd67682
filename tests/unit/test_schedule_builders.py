"""Tier (a), no processes: every builder validates and computes the collective it claims.

The symbolic validator runs inside ``build``; these tests drive it over the
whole option grid, execute schedules on integer data against the references,
pin the paper's Figures 6 and 7, and prove the validator catches broken
schedules.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from commfuse.errors import InvalidScheduleError, ScheduleError
from commfuse.schedule import (
    ALGORITHMS,
    Algorithm,
    Collective,
    Ring,
    Schedule,
    SliceId,
    Step,
    Transfer,
    all_gather_ref,
    all_to_all_ref,
    build,
    reduce_scatter_ref,
    run_schedule,
    validate,
)

RINGS = (Algorithm.RING, Algorithm.BIDIRECTIONAL)
VARIANTS = [(c, a) for c, algs in ALGORITHMS.items() for a in algs]


def options(algorithm: Algorithm, k: int) -> dict:
    if algorithm in RINGS:
        return {"parts": k}
    if algorithm is Algorithm.SLICED:
        return {"chunks": k}
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("collective,algorithm", VARIANTS, ids=lambda v: str(v))
def test_every_builder_validates_for_world_sizes_1_to_33(collective, algorithm):
    for n in range(1, 34):
        for k in (1, 2, 3):
            s = build(collective, n, algorithm=algorithm, **options(algorithm, k))
            if n == 33:  # build() runs the exhaustive pass up to 32 itself
                validate(s, exhaustive=True)
            assert s.world_size == n and s.num_steps >= 1


def _values(schedule, data):
    """Run ``schedule`` on values and the reference on the same values; return both, per rank."""
    n, pieces = schedule.world_size, schedule.pieces
    got = run_schedule(schedule, data)
    if schedule.collective is Collective.ALL_GATHER:
        ref = all_gather_ref([[data(r, x) for x in schedule.slices(r)] for r in range(n)])
        mine = [sorted((x.shard, schedule.piece(x), v) for x, v in rank) for rank in got]
        want = [sorted((q, i, v) for q, shard in enumerate(row) for i, v in enumerate(shard)) for row in ref]
    elif schedule.collective is Collective.PRODUCE_ALL_TO_ALL:
        ref = all_to_all_ref([[[data(r, x) for x in schedule.slices(d, r)] for d in range(n)] for r in range(n)])
        mine = [sorted((x.source, schedule.piece(x), v) for x, v in rank) for rank in got]
        want = [sorted((s, i, v) for s, block in enumerate(row) for i, v in enumerate(block)) for row in ref]
    elif schedule.collective is Collective.ALL_TO_ALL:
        ref = all_to_all_ref([[[data(r, x) for x in schedule.slices(d, r)] for d in range(n)] for r in range(n)])
        mine = [sorted((x.source, schedule.piece(x), v) for x, v in rank) for rank in got]
        want = [sorted((s, i, v) for s, block in enumerate(row) for i, v in enumerate(block)) for row in ref]
    else:
        ref = reduce_scatter_ref(
            [[[data(r, x) for x in schedule.slices(d)] for d in range(n)] for r in range(n)],
            add=lambda a, b: [x + y for x, y in zip(a, b)],
        )
        mine = [[v for _, v in rank] for rank in got]
        want = ref
    assert len(got) == n and all(len(rank) == n * pieces or schedule.collective is Collective.REDUCE_SCATTER for rank in got)
    return mine, want


@given(
    variant=st.sampled_from(VARIANTS),
    n=st.integers(1, 9),
    k=st.integers(1, 3),
    data=st.data(),
)
def test_schedules_compute_the_reference_on_integers(variant, n, k, data):
    collective, algorithm = variant
    order = data.draw(st.permutations(range(n)))
    direction = data.draw(st.sampled_from([1, -1]))
    s = build(collective, n, algorithm=algorithm, ring=Ring(n, tuple(order), direction), **options(algorithm, k))
    validate(s, exhaustive=True)

    def value(rank, x):
        # distinct per (rank, slice), so a wrong delivery or a double count shows
        return 1 + rank * 1_000_003 + x.shard * 10_007 + s.piece(x) * 101 + (x.source or 0) * 7

    mine, want = _values(s, value)
    assert mine == want


def test_references_agree_with_direct_computation():
    shards = ["a", "b", "c"]
    assert all_gather_ref(shards) == [["a", "b", "c"]] * 3
    partials = [[r * 10 + d for d in range(3)] for r in range(3)]
    assert reduce_scatter_ref(partials) == [sum(r * 10 + d for r in range(3)) for d in range(3)]
    blocks = [[f"{r}>{d}" for d in range(3)] for r in range(3)]
    assert all_to_all_ref(blocks) == [[f"{s}>{d}" for s in range(3)] for d in range(3)]
    with pytest.raises(ScheduleError, match="rank 1 gives 2 blocks, expected one per rank \\(3\\)"):
        reduce_scatter_ref([[1, 2, 3], [1, 2], [1, 2, 3]])


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_all_gather_is_figure_6(n):
    """Rank r computes shard (r - k) mod N at step k and forwards it to r + 1; the last step only computes."""
    s = build("all_gather", n, algorithm="ring")
    assert s.num_steps == n
    for r in range(n):
        for k, step in enumerate(s.steps(r)):
            assert step.compute == (SliceId((r - k) % n),)
            if k < n - 1:
                assert step.sends == (Transfer(SliceId((r - k) % n), (r + 1) % n, 1),)
                assert step.recvs == (Transfer(SliceId((r - k - 1) % n), (r - 1) % n, 1),)
            else:
                assert not step.communicates


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_reduce_scatter_is_figure_7(n):
    """Step k computes the partial of output shard (r - 1 - k) mod N; step 0 needs no receive; own shard last."""
    s = build("reduce_scatter", n, algorithm="ring")
    for r in range(n):
        steps = s.steps(r)
        assert not steps[0].communicates
        for k, step in enumerate(steps):
            assert step.compute == (SliceId((r - 1 - k) % n),)
            if k:
                assert step.sends == (Transfer(SliceId((r - k) % n), (r + 1) % n, 1),)
                assert step.recvs == (Transfer(SliceId((r - 1 - k) % n), (r - 1) % n, 1),)
                assert step.accumulate == step.compute
        assert steps[-1].compute == (SliceId(r),)


@pytest.mark.parametrize("n", list(range(1, 34)))
def test_tail_property_holds_for_every_world_size(n):
    for algorithm in RINGS:
        for collective in (Collective.ALL_GATHER, Collective.ALL_TO_ALL):
            if algorithm in ALGORITHMS[collective]:
                assert not build(collective, n, algorithm=algorithm).steps(n - 1)[-1].communicates
        rs = build("reduce_scatter", n, algorithm=algorithm)
        for r in (0, n - 1):
            last = rs.steps(r)[-1]
            assert {x.shard for x in last.compute} == {r}
            assert not last.collectives
            assert set(last.accumulate) == (set(last.compute) if n > 1 else set())


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_produce_all_to_all_sends_the_block_made_one_hop_before(n):
    """Hop 0 makes the block for r + 1; hop k sends the block for r + k while making r + k + 1 (its own last)."""
    s = build("produce_all_to_all", n, algorithm="ring")
    for r in range(n):
        steps = s.steps(r)
        assert not steps[0].communicates and steps[0].compute == (SliceId((r + 1) % n, source=r),)
        for k, step in enumerate(steps[1:], start=1):
            assert step.sends == (Transfer(SliceId((r + k) % n, source=r), (r + k) % n, k),)
            assert step.recvs == (Transfer(SliceId(r, source=(r - k) % n), (r - k) % n, k),)
            made = (r + k + 1) % n if k < n - 1 else r
            assert step.compute == (SliceId(made, source=r),)
        assert steps[-1].communicates and steps[-1].compute == (SliceId(r, source=r),)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 3])
def test_ring_all_to_all_in_parts_computes_each_part_the_step_after_it_arrives(n, m):
    """ring:m leads each received part's compute by one step, not one block: (n - 1) m + 1 steps, the own
    block's parts one per step over the first m, every other step's compute the part received just before."""
    s = build("all_to_all", n, algorithm="ring", parts=m)
    for r in range(n):
        steps = s.steps(r)
        assert len(steps) == (n - 1) * m + 1
        arrived = {}
        for t, step in enumerate(steps):
            for recv in step.recvs:
                arrived[recv.slice] = t
            own = [x for x in step.compute if x.source == r]
            assert own == ([SliceId(r, t, source=r)] if t < m else []), (r, t, step.compute)
            for x in step.compute:
                if x.source != r:
                    assert arrived[x] == t - 1, (r, t, x)
        assert not steps[-1].communicates and len(steps[-1].compute) == 1


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 3])
def test_ring_produce_all_to_all_in_parts_sends_each_part_the_step_after_it_is_made(n, m):
    """The mirror image: each part made for a peer travels in the next step, and the own block's parts fill
    the last m steps, so the last transfers fly under them."""
    s = build("produce_all_to_all", n, algorithm="ring", parts=m)
    for r in range(n):
        steps = s.steps(r)
        assert len(steps) == (n - 1) * m + 1
        made = {}
        for t, step in enumerate(steps):
            for send in step.sends:
                assert made[send.slice] == t - 1, (r, t, send.slice)
            for x in step.compute:
                made[x] = t
            own = [x for x in step.compute if x.shard == r]
            first_own = len(steps) - m
            assert own == ([SliceId(r, t - first_own, source=r)] if t >= first_own else []), (r, t, step.compute)
        assert not steps[0].communicates and steps[-1].communicates


def test_validator_rejects_a_produce_all_to_all_that_sends_a_block_as_it_makes_it():
    """The payload of a send is read at the start of its step: a block made in that step is not there yet."""
    good = build("produce_all_to_all", 3, algorithm="ring")
    template = list(good.template)
    late = template[1]
    template[1] = Step(1, late.sends, late.recvs, (), (late.sends[0].slice,))
    template[0] = Step(0, compute=(late.compute[0],))
    bad = Schedule(good.collective, 3, good.algorithm, ring=good.ring, template=tuple(template))
    with pytest.raises(InvalidScheduleError, match="sends block 0>1 to rank 1 without producing it"):
        validate(bad)


def test_sliced_reduce_scatter_has_an_exposed_tail_and_ring_does_not():
    sliced = build("reduce_scatter", 4, algorithm="sliced", chunks=4)
    assert sliced.steps(0)[-1].collectives and not sliced.steps(0)[-1].compute
    assert build("reduce_scatter", 4, algorithm="ring").steps(0)[-1].compute


def test_bidirectional_halves_per_hop_bytes_and_uses_both_directions():
    s = build("all_gather", 5, algorithm="bidirectional")
    assert s.pieces == 2
    step = s.steps(2)[0]
    assert {(t.peer, t.slice.half) for t in step.sends} == {(3, 0), (1, 1)}
    assert {t.channel for t in step.sends} == {0, 1}


def test_world_size_one_is_computation_alone():
    for collective, algorithm in VARIANTS:
        s = build(collective, 1, algorithm=algorithm)
        (step,) = s.steps(0)
        assert not step.communicates and not step.accumulate and step.compute


def test_custom_ring_order_routes_through_the_ring():
    ring = Ring(4, (0, 2, 1, 3))
    s = build("all_gather", 4, ring=ring)
    assert s.peers(0) == (2, 3)
    assert s.steps(2)[0].sends[0].peer == 1
    assert ring.pairs(1) == ((0, 2), (2, 1), (1, 3), (3, 0))


def test_all_to_all_exchanges_with_r_plus_k_and_r_minus_k():
    n = 5
    s = build("all_to_all", n)
    for r in range(n):
        for k, step in enumerate(s.steps(r)[:-1]):
            (send,) = step.sends
            (recv,) = step.recvs
            assert send.peer == (r + k + 1) % n and recv.peer == (r - k - 1) % n
            assert send.slice == SliceId((r + k + 1) % n, source=r)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: build("all_gather", 0), "world_size must be >= 1, got 0"),
        (lambda: build("all_gather", -3), "got -3"),
        (lambda: build("all_gather", "4"), "world_size must be an integer, got '4'"),
        (lambda: build("all_gather", 4, algorithm="tree"), "unknown algorithm 'tree'"),
        (lambda: build("broadcast", 4), "unknown collective 'broadcast'"),
        (lambda: build("all_gather", 4, parts=0), "parts must be >= 1, got 0"),
        (lambda: build("all_gather", 4, parts=2.5), "parts must be an integer, got 2.5"),
        (lambda: build("all_gather", 4, algorithm="vanilla", parts=2), "parts=2 applies to the ring algorithms only"),
        (lambda: build("all_gather", 4, algorithm="sliced", parts=2), "use chunks="),
        (lambda: build("reduce_scatter", 4, algorithm="ring", chunks=3), "chunks=3 applies to algorithm 'sliced' only"),
        (lambda: build("all_to_all", 4, algorithm="bidirectional"), "'bidirectional' is not defined for all_to_all"),
        (lambda: build("all_gather", 4, ring=Ring(3)), "ring has world size 3 but the schedule has 4"),
        (lambda: Ring(3, (0, 1, 1)), "permutation of ranks 0..2"),
        (lambda: Ring(3, direction=2), "direction must be +1 or -1, got 2"),
        (lambda: Ring(3).position(5), "rank 5 is outside the ring of world size 3"),
    ],
)
def test_bad_options_raise_errors_that_name_the_value(call, message):
    with pytest.raises(ScheduleError, match=message.replace("(", "\\(").replace(")", "\\)").replace("+", "\\+")):
        call()


def _broken(schedule, index, **change):
    template = list(schedule.template)
    template[index] = dataclasses.replace(template[index], **change)
    return dataclasses.replace(schedule, template=tuple(template))


@pytest.mark.parametrize("exhaustive", [False, True])
def test_validator_catches_broken_schedules(exhaustive):
    ag = build("all_gather", 4)
    rs = build("reduce_scatter", 4)
    step = ag.template[0]
    cases = [
        (_broken(ag, 0, sends=(dataclasses.replace(step.sends[0], peer=2),)), "ring does not place there"),
        (_broken(ag, 0, sends=(dataclasses.replace(step.sends[0], peer=2, shift=2),)), "do not form one permutation"),
        (_broken(ag, 0, sends=(dataclasses.replace(step.sends[0], slice=SliceId(1)),)), "sends to rank 1 .* but rank 1 receives"),
        (_broken(ag, 1, recvs=()), "sends to rank 1 .* but rank 1 receives nothing"),
        (_broken(ag, 3, compute=(SliceId(0),)), "computed on missing \\[shard 1\\], extra \\[shard 0\\]"),
        (_broken(ag, 3, sends=ag.template[2].sends, recvs=ag.template[2].recvs), "already holds|tail|without holding"),
        (_broken(ag, 0, compute=(SliceId(2),)), "computes on .* before holding it"),
        (_broken(rs, 1, accumulate=()), "drops the received running sum"),
        (_broken(rs, 2, accumulate=rs.template[2].accumulate * 1, compute=(SliceId(1), SliceId(1))), "second time|twice"),
        (_broken(rs, 0, compute=(SliceId(0),)), "computes the partial of|counts ranks|sends the running sum"),
    ]
    for bad, pattern in cases:
        with pytest.raises(InvalidScheduleError, match=pattern):
            validate(bad, exhaustive=exhaustive) if exhaustive else validate(bad)


def test_validator_reports_an_exposed_tail():
    # Data slicing's reduce-scatter ends with a collective and no compute: a
    # correct result, but with its tail exposed, so it must not pass as a ring.
    sliced = build("reduce_scatter", 3, algorithm="sliced", chunks=2)
    posing = dataclasses.replace(sliced, algorithm=Algorithm.RING, parts=2, chunks=1)
    with pytest.raises(InvalidScheduleError, match="exposed tail"):
        validate(posing)


def test_schedule_core_imports_no_torch():
    code = "import sys, commfuse, commfuse.schedule; commfuse.schedule.build('all_gather', 8); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_steps_are_frozen_and_shared_template_is_rank_zero():
    s = build("reduce_scatter", 4)
    assert s.steps(0) is s.template
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps(1)[0].index = 3  # type: ignore[misc]
    assert isinstance(s.steps(1)[0], Step)
    assert s.steps(1) == build("reduce_scatter", 4).steps(1)


@pytest.mark.parametrize("n", (2, 3, 5))
@pytest.mark.parametrize("m", (2, 3))
def test_ring_parts_compute_each_slice_next_to_its_transfer(n, m):
    """ring:m all-gather: every received slice is computed in the step right after it arrived, so the step
    after the last transfer computes one slice (per half), not a whole shard; reduce-scatter: every slice of
    the first partial leaves in the step after the one that made it, so only step 0 computes with nothing in
    flight. Both take (N - 1) m + 1 steps, where hop by hop took N m."""
    for algorithm in RINGS:
        halves = 2 if algorithm is Algorithm.BIDIRECTIONAL else 1
        ag = build("all_gather", n, algorithm=algorithm, parts=m)
        rs = build("reduce_scatter", n, algorithm=algorithm, parts=m)
        assert len(ag.steps(0)) == len(rs.steps(0)) == (n - 1) * m + 1
        for r in range(n):
            steps = ag.steps(r)
            arrived = {}
            for st in steps:
                for t in st.recvs:
                    arrived[t.slice] = st.index
            for st in steps:
                for x in st.compute:
                    if x in arrived:
                        assert st.index == arrived[x] + 1, (algorithm, r, x, st.index, arrived[x])
            assert not steps[-1].sends and len(steps[-1].compute) == halves
            rsteps = rs.steps(r)
            made = {}
            for st in rsteps:
                for x in st.compute:
                    made.setdefault(x, st.index)
            for st in rsteps:
                for t in st.sends:
                    if not any(t.slice in other.accumulate for other in rsteps):  # the first partial's slices
                        assert st.index == made[t.slice] + 1, (algorithm, r, t.slice, st.index, made[t.slice])
            assert [bool(st.sends) for st in rsteps] == [False] + [True] * (len(rsteps) - 1)
