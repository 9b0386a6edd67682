"""Tier (a), no processes: what ``algorithm="auto"`` takes without a profile, per the backend's capabilities, and
how long a choice is remembered."""

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
    for collective in Collective:
        assert ops.choose_algorithm(collective, 4, small, Capabilities())[0] == "vanilla"
        assert ops.choose_algorithm(collective, 4, large, Capabilities())[0] == "ring"
        assert ops.choose_algorithm(collective, 4, small, None)[0] == "vanilla"
        assert ops.choose_algorithm(collective, 1, large, Capabilities())[0] == "vanilla"  # nothing to send


def test_a_backend_threshold_replaces_the_default(monkeypatch):
    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    name, why = ops.choose_algorithm(Collective.ALL_GATHER, 4, 2048, Capabilities(auto_min_slice_bytes=4096))
    assert name == "vanilla" and "under 4096" in why
    assert ops.choose_algorithm(Collective.ALL_GATHER, 4, 4096, Capabilities(auto_min_slice_bytes=4096))[0] == "ring"
    # gloo: measured ring hops beat its collectives at every size (docs/benchmarks.md), so even 1 byte rings
    gloo = _gloo_capabilities()
    assert gloo.auto_min_slice_bytes == 0
    for collective in Collective:
        assert ops.choose_algorithm(collective, 3, 1, gloo)[0] == "ring"


def test_auto_remembers_a_choice_for_its_recheck_time_then_looks_again(monkeypatch):
    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    backend = types.SimpleNamespace(name="no-such-backend", device=torch.device("cpu"), capabilities=Capabilities())
    now = [1000.0]
    monkeypatch.setattr(ops.time, "monotonic", lambda: now[0])
    ops._CHOSEN.clear()
    args = (Collective.ALL_GATHER, 8, 64 << 20, backend, 1e12)
    first = ops._auto(*args)
    assert first[0] == "ring" and "model" not in first[1]  # no profile applies: the size rule
    monkeypatch.setenv("COMMFUSE_PROFILE", "h100-sxm")
    now[0] += ops.AUTO_RECHECK_S / 2
    assert ops._auto(*args) == first  # remembered
    other = types.SimpleNamespace(**vars(backend))
    assert "h100-sxm" in ops._auto(Collective.ALL_GATHER, 8, 64 << 20, other, 1e12)[1]  # another backend: chosen anew
    now[0] += ops.AUTO_RECHECK_S
    again = ops._auto(*args)
    assert "model of profile 'h100-sxm'" in again[1]  # looked again and found the profile
    ops.release_backends()
    assert not ops._CHOSEN
