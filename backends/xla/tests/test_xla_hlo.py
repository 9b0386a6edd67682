"""Tier (a), no processes, any environment: the HLO parser reads what torch_xla 2.9 prints
(golden files traced by commfuse_xla.verify) and refuses what it cannot read, naming the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from commfuse_xla import hlo

DATA = Path(__file__).parent / "data"


def _entry(name: str) -> hlo.Computation:
    return hlo.parse((DATA / name).read_text()).entry


def test_ring_all_gather_rank1_of_4():
    entry = _entry("all_gather_matmul_ring_w4_r1.hlo")
    permutes = entry.topological([i.name for i in entry.of("collective-permute")])
    assert len(permutes) == 3
    for name in permutes:
        assert entry.instructions[name].source_target_pairs == ((0, 1), (1, 2), (2, 3), (3, 0))
    # Each permute follows the previous one (torch_xla threads its token through them).
    assert all(entry.depends(permutes[i], permutes[i - 1]) for i in (1, 2))
    dots = [i.name for i in entry.of("dot")]
    # Dot k waits for exactly permutes 0..k-1: one dot per ring step, overlappable with the next permute.
    frontier = sorted(max((k for k, p in enumerate(permutes) if entry.depends(d, p)), default=-1) for d in dots)
    assert frontier == [-1, 0, 1, 2]
    assert entry.root.opcode == "tuple"


def test_ring_reduce_scatter_rank0_of_3():
    entry = _entry("matmul_reduce_scatter_ring_w3_r0.hlo")
    permutes = entry.topological([i.name for i in entry.of("collective-permute")])
    assert [entry.instructions[p].source_target_pairs for p in permutes] == [((0, 1), (1, 2), (2, 0))] * 2
    dots = [i.name for i in entry.of("dot")]
    assert len(dots) == 3
    assert not any(entry.depends(d, p) for d in dots for p in permutes)
    first_user = sorted(min((k for k, p in enumerate(permutes) if entry.depends(p, d)), default=-1) for d in dots)
    assert first_user == [-1, 0, 1]


def test_vanilla_reduce_scatter_has_replica_groups_and_a_called_computation():
    module = hlo.parse((DATA / "matmul_reduce_scatter_vanilla_w4_r2.hlo").read_text())
    assert len(module.computations) == 2
    (rs,) = module.entry.of("reduce-scatter")
    assert rs.replica_groups == ((0, 1, 2, 3),)
    assert rs.attribute("dimensions") == "{0}"
    assert not module.entry.of("collective-permute")


def test_bare_names_and_tuple_shapes_parse():
    text = """HloModule m

ENTRY main {
  p = f32[2]{0} parameter(0)
  t = (f32[2]{0}, (u32[], s32[])) tuple(p, p)
  g = f32[2]{0} get-tuple-element(t), index=0
  ROOT cp = f32[2]{0} collective-permute(g), channel_id=1, source_target_pairs={{0,1},{1,0}}
}
"""
    entry = hlo.parse(text).entry
    assert entry.instructions["t"].operands == ("p", "p")
    assert entry.root.source_target_pairs == ((0, 1), (1, 0))
    assert entry.ancestors("cp") == {"g", "t", "p"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("HloModule m\n\nENTRY e {\n  %a = f32[] parameter(0)\n", "not closed"),
        ("HloModule m\n\nENTRY e {\n  nonsense here\n}\n", "line 4: expected an instruction"),
        ("HloModule m\n\nENTRY e {\n  %a = f32[] (((\n}\n", "line 4"),
        ("HloModule m\n", "no computation"),
    ],
)
def test_unreadable_hlo_names_the_line(text, message):
    with pytest.raises(hlo.HloParseError, match=message):
        hlo.parse(text)
