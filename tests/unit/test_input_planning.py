"""Tier (a), no processes: what the planning code decides once per call signature to keep inputs safe.

Which slices a user's consumer gets a private copy of (exactly those a later transfer reads or that are
the caller's own, never an arrived chunk that is not sent on), how a layer's options read back from a
fingerprint, and how ``ring:m`` is capped at one row per slice.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from commfuse.planning.calls import Call
from commfuse.runtime.compiled import Compiled
from commfuse.planning.consumers import handed_over
from commfuse.planning.derive import capped, configured, layer_config
from commfuse.runtime.fingerprints import (
    CONFIG_MARK,
    config_values,
    config_words,
    describe_config,
    describe_fingerprint,
    format_code,
)
from commfuse.schedule import SliceId, build, parse_algorithm


def _copied(collective, n, rank, algorithm, inputs, overlap=True, **kw):
    compiled = Compiled(build(collective, n, algorithm=algorithm, **kw), rank)
    own = inputs(compiled)
    return {compiled.slices[s] for s in handed_over(compiled, own, overlap)}


def _own_shard(compiled):
    return compiled.slots_of(compiled.rank)


def _own_block(compiled):
    return compiled.slots_of(compiled.rank, compiled.rank)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_ring_all_gather_copies_its_own_shard_and_what_it_forwards_but_not_the_last_arrival(n):
    for rank in range(n):
        got = _copied("all_gather", n, rank, "ring", _own_shard)
        # step k computes shard rank - k and forwards it, but for the last step's
        forwarded = {SliceId((rank - k) % n) for k in range(n - 1)}
        assert got == forwarded, (rank, got)
        assert SliceId((rank + 1) % n) not in got  # the last shard to arrive is sent nowhere


def test_serial_waits_for_its_sends_before_computing_so_only_the_callers_shard_is_copied():
    assert _copied("all_gather", 3, 0, "ring", _own_shard, overlap=False) == {SliceId(0)}


@pytest.mark.parametrize("algorithm", ["ring", "vanilla"])
def test_an_all_to_all_copies_only_the_callers_own_chunk(algorithm):
    for rank in range(3):
        assert _copied("all_to_all", 3, rank, algorithm, _own_block) == {SliceId(rank, 0, 0, rank)}


def test_a_whole_gather_into_one_tensor_copies_nothing():
    assert _copied("all_gather", 3, 1, "vanilla", lambda c: ()) == set()
    assert _copied("all_gather", 3, 1, "vanilla", _own_shard) == {SliceId(1)}


def test_a_layers_options_read_back_by_name_on_the_rank_that_compares():
    config_words("gelu", "relu")
    values = config_values("Layer", [("causal", True), ("scale", 0.125), ("heads", 4), ("activation", "relu")])
    assert values[-1] == CONFIG_MARK and values[-3] == 4
    own, words = describe_config([1, 2, 3, *values])
    assert own == [1, 2, 3]
    assert words == "Layer(causal=True, scale=0.125, heads=4, activation='relu')"
    # a fingerprint reads back with the op's own format, the options after it
    fingerprint = [0xC0F5, 7, format_code("produce_reduce_scatter"), 1, 0, 1, 1, 1, 0, 1, 3, 2, 4, 8, *values]
    text = describe_fingerprint(fingerprint)
    assert text.endswith("partials float32[2, 4, 8] cut along dim 1; " + words), text
    assert describe_config([1, 2, 3]) == ([1, 2, 3], None)


def _call(algorithm: str, rank: int = 0) -> Call:
    return Call(SimpleNamespace(rank=rank, world_size=2), parse_algorithm(algorithm), 10.0, "once")


def test_ring_m_is_capped_at_one_row_per_slice_once_and_said_once(caplog):
    call = _call("ring:10000")
    with caplog.at_level(logging.WARNING, logger="commfuse"):
        first = capped(call, 4, "all_gather_consume")
        again = capped(call, 4, "all_gather_consume")
    assert first is again and first.spec.shown == "ring:4" and first.timeout == call.timeout
    said = [r.getMessage() for r in caplog.records if r.name == "commfuse"]
    assert len(said) == 1 and "'ring:10000'" in said[0] and "'ring:4'" in said[0] and "4 rows" in said[0], said
    assert "ring:4" in first.reason


@pytest.mark.parametrize("algorithm, rows, taken", [
    ("ring:2", 2, "ring:2"), ("ring:3", 2, "ring:2"), ("ring:4", 1, "ring"), ("ring:4", 0, "ring"),
    ("serial:8", 5, "serial:5"), ("bidirectional:4", 5, "bidirectional:2"), ("bidirectional:2", 1, "bidirectional"),
    ("sliced:4", 2, "sliced:4"), ("ring", 1, "ring"),
])
def test_what_is_capped_and_to_what(algorithm, rows, taken):
    assert capped(_call(algorithm), rows, "op").spec.shown == taken


def test_a_capped_call_keeps_the_layers_options():
    call = configured(_call("ring:64"), layer_config("Layer", bias=True))
    got = capped(call, 3, "op")
    assert got.spec.shown == "ring:3" and got.config == call.config and configured(_call("ring"), None) is not None
