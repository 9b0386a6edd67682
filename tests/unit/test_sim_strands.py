"""Tier (a), no processes: the two-strand plan search (``commfuse.sim._strands``) against brute force, its
rules (order kept, never two transfers on one link paired, the same plan from the same inputs), the block
stages it is given, and ``commfuse simulate --strands``."""

from __future__ import annotations

import functools
import random

import pytest

from commfuse.cli import main
from commfuse.errors import CommfuseValueError
from commfuse.sim import load_profile
from commfuse.sim import _strands as strands
from commfuse.sim._strands import Stage


def _brute(a: tuple, b: tuple, slowdown: float) -> float:
    """The least total over every order and pairing (each strand in its order, no conflicting pair)."""

    @functools.lru_cache(maxsize=None)
    def rest(i: int, j: int) -> float:
        if i == len(a) and j == len(b):
            return 0.0
        options = []
        if i < len(a):
            options.append(a[i].alone + rest(i + 1, j))
        if j < len(b):
            options.append(b[j].alone + rest(i, j + 1))
        if i < len(a) and j < len(b) and not strands.conflict(a[i], b[j]):
            options.append(strands.together(a[i], b[j], slowdown) + rest(i + 1, j + 1))
        return min(options)

    return rest(0, 0)


def _random_strand(rng: random.Random, n: int, tag: str) -> tuple:
    out = []
    for k in range(n):
        comm = 0.0 if rng.random() < 0.4 else rng.uniform(0.1, 3.0)
        out.append(Stage(f"{tag}{k}", rng.uniform(0.1, 3.0), comm, link=rng.choice(["link", "link", "nvlink"]),
                         ring=rng.choice([2, 4, 8])))
    return tuple(out)


@pytest.mark.parametrize("seed", range(40))
def test_the_search_finds_the_least_time_brute_force_finds(seed):
    rng = random.Random(seed)
    a, b = _random_strand(rng, rng.randint(0, 5), "a"), _random_strand(rng, rng.randint(0, 5), "b")
    slowdown = rng.choice([0.0, 0.1, 0.3])
    found = strands.plan(a, b, slowdown=slowdown)
    assert found.seconds == pytest.approx(_brute(a, b, slowdown), rel=1e-12, abs=1e-15)
    # each strand's stages once each, in their order; no pair of transfers on one link
    assert [s.a for s in found.slots if s.a is not None] == list(range(len(a)))
    assert [s.b for s in found.slots if s.b is not None] == list(range(len(b)))
    assert not any(s.a is not None and s.b is not None and strands.conflict(a[s.a], b[s.b]) for s in found.slots)
    assert found.bound <= found.seconds + 1e-12 and found.seconds <= found.single + 1e-12
    assert strands.plan(list(a), list(b), slowdown=slowdown) == found  # the same inputs, the same plan


def test_a_long_transfer_is_paired_with_the_other_strands_compute():
    dispatch = Stage("dispatch", compute=1.0, comm=10.0, ring=2)
    attention = Stage("attention", compute=9.0)
    found = strands.plan([dispatch], [attention])
    assert [(s.a, s.b) for s in found.slots] == [(0, 0)]
    assert found.seconds == pytest.approx(10.0)  # the link's 10 s, both computes under it
    assert found.single == pytest.approx(10.5 + 9.0)


def test_two_transfers_on_one_link_are_never_paired_but_on_two_links_they_may_be():
    x = Stage("x", compute=5.0, comm=5.0)
    y = Stage("y", compute=5.0, comm=5.0)
    assert all(s.a is None or s.b is None for s in strands.plan([x], [y]).slots)
    z = Stage("z", compute=1.0, comm=5.0, link="other")
    assert strands.plan([Stage("x", compute=1.0, comm=5.0)], [z]).slots[0] == strands.Slot(0, 0, 10.0)
    # the naive alternation pairs them anyway: the link carries both transfers
    assert strands.alternate([x], [y]).slots == (strands.Slot(0, 0, 10.0),)


def test_contention_slows_the_paired_compute_only_while_a_transfer_flies():
    a, b = Stage("a", compute=4.0, comm=1.0), Stage("b", compute=4.0)
    assert strands.together(a, b, 0.25) == pytest.approx(10.0)
    assert strands.together(Stage("c", compute=4.0), b, 0.25) == pytest.approx(8.0)


def test_a_bad_stage_or_slowdown_is_refused_by_name():
    with pytest.raises(CommfuseValueError, match="stage 'x': comm"):
        Stage("x", compute=1.0, comm=-1.0)
    with pytest.raises(CommfuseValueError, match="ring"):
        Stage("x", compute=1.0, ring=0)
    with pytest.raises(CommfuseValueError, match="slowdown"):
        strands.plan([Stage("x", compute=1.0)], [], slowdown=-0.5)
    with pytest.raises(CommfuseValueError, match="first strand"):
        strands.plan([(1.0, 2.0)], [])


def test_the_llama_and_moe_blocks_stages():
    profile = load_profile("h100-sxm")
    forward, backward = strands.llama_stages(profile, tp=4, tokens=4096, seq=4096, hidden=4096, ffn=16384)
    assert [s.name for s in forward] == ["gather + QKV", "attention core", "out-proj + reduce-scatter",
                                         "gather + w1/w3", "w2 + reduce-scatter"]
    assert [s.name for s in backward] == [s.name + " (backward)" for s in reversed(forward)]
    assert forward[1].comm == 0 and all(s.comm > 0 for s in forward if s is not forward[1])
    assert all(b.compute == pytest.approx(2 * f.compute) for f, b in zip(reversed(forward), backward))
    step = strands.predict_step(forward, backward)
    assert step.limit <= step.strands(step.searched) <= step.per_op <= step.vanilla
    moe_f, moe_b = strands.moe_stages(profile, ep=8, tokens=4096, seq=4096, hidden=4096, ffn=1536, topk=8,
                                      shared_ffn=1536)
    assert [s.name for s in moe_f][-1] == "shared experts" and moe_f[2].comm > 0 and moe_f[0].comm == 0
    with pytest.raises(CommfuseValueError, match="tp >= 2"):
        strands.llama_stages(profile, tp=1, tokens=8, seq=8, hidden=8, ffn=8)
    with pytest.raises(CommfuseValueError, match="divide by tp 3"):
        strands.llama_stages(profile, tp=3, tokens=8, seq=8, hidden=8, ffn=8)


def test_simulate_strands_prints_the_plan_and_the_step_four_ways(capsys):
    base = ["simulate", "--strands", "--profile", "h100-sxm", "--seq", "4096", "--hidden", "4096"]
    assert main([*base, "-w", "moe", "--ep", "8", "--ffn", "1536", "--topk", "8",
                 "--set", "link.bandwidth=25e9"]) == 0
    out = capsys.readouterr().out
    assert "MoE block, EP 8" in out and "searched plan" in out
    for row in ("vanilla (compute, then comm)", "per-op ring, micro-batches in turn", "two strands, naive alternation",
                "two strands, searched plan", "limit: max(total compute, total comm)"):
        assert row in out
    searched = float(out.split("two strands, searched plan")[1].split()[0])
    per_op = float(out.split("per-op ring, micro-batches in turn")[1].split()[0])
    assert searched < per_op  # the dispatch's long transfers travel under the other strand's attention
    assert main([*base, "-w", "mlp", "--tp", "4"]) == 0
    assert "Llama block, TP 4" in capsys.readouterr().out
    assert main([*base, "-w", "ag_matmul", "--tp", "4"]) != 0
    assert "not -w ag_matmul" in capsys.readouterr().err
    assert main([*base, "-w", "mlp", "--tp", "4", "--json"]) != 0
    assert "--json does not apply" in capsys.readouterr().err


def test_the_run_order_of_two_strands():
    from commfuse import strands as run_strands

    stages = [run_strands.Stage(name, lambda x: x) for name in ("a", "b", "c")]
    seq = run_strands.order(stages, micro_batches=2, plan="sequential")
    assert seq == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 2), ("B", 0, 1), ("B", 0, 0),
                   ("F", 1, 0), ("F", 1, 1), ("F", 1, 2), ("B", 1, 2), ("B", 1, 1), ("B", 1, 0)]
    alt = run_strands.order(stages, micro_batches=2, plan="auto")  # no figures: alternate
    assert alt == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 1, 0), ("B", 0, 2), ("F", 1, 1), ("B", 0, 1),
                   ("F", 1, 2), ("B", 0, 0), ("B", 1, 2), ("B", 1, 1), ("B", 1, 0)]
    # with figures: a transfer-heavy forward stage goes beside the backward's compute-only stage
    profiled = [run_strands.Stage("send", lambda x: x, compute=1.0, comm=8.0),
                run_strands.Stage("core", lambda x: x, compute=8.0)]
    searched = run_strands.order(profiled, micro_batches=2, plan="searched")
    assert searched[2:4] == [("F", 1, 0), ("B", 0, 1)] and len(searched) == 8
    for plan in ("searched", "alternate"):  # every (kind, micro-batch, stage) once, each strand in order
        got = run_strands.order(profiled, micro_batches=3, plan=plan)
        assert sorted(got) == sorted(run_strands.order(profiled, micro_batches=3, plan="sequential"))
    with pytest.raises(CommfuseValueError, match="missing for"):
        run_strands.order(stages, micro_batches=2, plan="searched")
    with pytest.raises(CommfuseValueError, match="plan must be"):
        run_strands.order(stages, micro_batches=2, plan="zigzag")


def test_the_order_of_two_forwards():
    from commfuse import strands as run_strands

    stages = [run_strands.Stage(name, lambda x: x) for name in ("a", "b", "c")]
    assert run_strands.order(stages, micro_batches=2, plan="sequential", forward_only=True) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 1, 0), ("F", 1, 1), ("F", 1, 2)]
    # the naive skew: the second micro-batch one stage behind the first; an odd last micro-batch alone
    assert run_strands.order(stages, micro_batches=3, plan="alternate", forward_only=True) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 0, 2), ("F", 1, 1), ("F", 1, 2), ("F", 2, 0), ("F", 2, 1),
        ("F", 2, 2)]
    # searched: each micro-batch's transfer-heavy stage beside the other's compute-only one, never two senders
    profiled = [run_strands.Stage("send", lambda x: x, compute=1.0, comm=8.0),
                run_strands.Stage("core", lambda x: x, compute=8.0),
                run_strands.Stage("send again", lambda x: x, compute=1.0, comm=8.0)]
    got = run_strands.order(profiled, micro_batches=4, plan="searched", forward_only=True)
    assert sorted(got) == sorted(run_strands.order(profiled, micro_batches=4, plan="sequential", forward_only=True))
    for i in (0, 2):  # each pair: micro-batches i and i + 1, each in its stage order
        for mb in (i, i + 1):
            mine = [k for kind, j, k in got if j == mb]
            assert mine == [0, 1, 2], (mb, got)
    slots = run_strands._forward_slots(profiled, 2, "searched", 0.0)
    for slot in slots:
        assert not (len(slot) == 2 and all(profiled[k].comm > 0 for _, _, k in slot)), slots
    assert any(len(slot) == 2 for slot in slots), slots
    with pytest.raises(CommfuseValueError, match="missing for"):
        run_strands.order(stages, micro_batches=2, plan="searched", forward_only=True)
