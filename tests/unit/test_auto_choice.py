"""Tier (a), no processes: what ``algorithm="auto"`` takes without a profile, per the backend's capabilities, and
how long a choice is remembered (once per call signature, until ``commfuse.backends.release``)."""

from __future__ import annotations

import types

import torch

from commfuse import ops
from commfuse.plugins import Capabilities
from commfuse.plugins.builtin import commfuse_backends
from commfuse.schedule import Collective


def _gloo_capabilities() -> Capabilities:
    return next(spec for spec in commfuse_backends() if spec.name == "gloo").capabilities


def test_default_threshold_sends_tiny_slices_to_vanilla_and_large_ones_to_the_ring(monkeypatch):
    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    small, large = ops.MIN_SLICE_BYTES - 1, ops.MIN_SLICE_BYTES
    caps = Capabilities(overlap=True)
    for collective in Collective:
        assert ops.choose_algorithm(collective, 4, small, caps)[0] == "vanilla"
        assert ops.choose_algorithm(collective, 4, large, caps)[0] == "ring"
        assert ops.choose_algorithm(collective, 4, small, None)[0] == "vanilla"
        assert ops.choose_algorithm(collective, 4, large, None)[0] == "ring"
        assert ops.choose_algorithm(collective, 1, large, caps)[0] == "vanilla"  # nothing to send


def test_an_eager_backend_without_overlap_takes_vanilla_and_a_traced_one_is_left_to_its_compiler(monkeypatch):
    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    name, why = ops.choose_algorithm(Collective.ALL_GATHER, 4, 1 << 30, Capabilities(overlap=False))
    assert name == "vanilla" and "declares no overlap" in why
    traced = Capabilities(overlap=False, execution="traced")
    assert ops.choose_algorithm(Collective.ALL_GATHER, 4, 1 << 30, traced)[0] == "ring"


def test_a_profile_offers_bidirectional_only_to_backends_with_bidirectional_links(monkeypatch):
    from commfuse.sim import choose

    # on the 910B profile both link directions pay off for these shapes
    both = choose("all_gather", 4, slice_bytes=16 << 20, flops=1e9, profile="ascend-910b")
    one_way = choose("all_gather", 4, slice_bytes=16 << 20, flops=1e9, profile="ascend-910b", bidirectional=False)
    assert both[0] == "bidirectional" and one_way[0] != "bidirectional", (both, one_way)
    assert "bidirectional" not in one_way[1]


def test_a_backend_threshold_replaces_the_default(monkeypatch):
    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    name, why = ops.choose_algorithm(Collective.ALL_GATHER, 4, 2048, Capabilities(auto_min_slice_bytes=4096,
                                                                                    overlap=True))
    assert name == "vanilla" and "under 4096" in why
    caps = Capabilities(auto_min_slice_bytes=4096, overlap=True)
    assert ops.choose_algorithm(Collective.ALL_GATHER, 4, 4096, caps)[0] == "ring"
    # gloo: measured ring hops beat its collectives at every size (docs/benchmarks.md), so even 1 byte rings
    gloo = _gloo_capabilities()
    assert gloo.auto_min_slice_bytes == 0
    for collective in Collective:
        assert ops.choose_algorithm(collective, 3, 1, gloo)[0] == "ring"


class _Backend(types.SimpleNamespace):
    __hash__ = object.__hash__  # backend objects are hashable (by identity), as call signatures need


def test_auto_is_decided_once_per_call_signature_until_release(monkeypatch):
    from commfuse import backends
    from commfuse.runtime.calls import resolve_call

    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    backends.release()
    backend = _Backend(name="no-such-backend", device=torch.device("cpu"), capabilities=Capabilities(overlap=True),
                       rank=0, world_size=8)
    report: dict = {}
    first = resolve_call(Collective.ALL_GATHER, "auto", backend=backend, slice_bytes=64 << 20, flops=1e12,
                         report=report)
    assert first.spec.name == "ring" and "model" not in first.reason  # no profile applies: the size rule
    assert report == {"algorithm": "ring", "reason": first.reason, "world_size": 8}
    monkeypatch.setenv("COMMFUSE_PROFILE", "h100-sxm")
    assert resolve_call(Collective.ALL_GATHER, "auto", backend=backend, slice_bytes=64 << 20, flops=1e12) is first
    other = resolve_call(Collective.ALL_GATHER, "auto", backend=backend, slice_bytes=32 << 20, flops=1e12)
    assert "h100-sxm" in other.reason  # a new signature is decided anew
    backends.release()
    again = resolve_call(Collective.ALL_GATHER, "auto", backend=backend, slice_bytes=64 << 20, flops=1e12)
    assert again is not first and "model of profile 'h100-sxm'" in again.reason
    backends.release()
