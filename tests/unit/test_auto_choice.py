"""Tier (a), no processes: what ``algorithm="auto"`` takes without a profile, per the backend's capabilities, how
long a choice is remembered (once per call signature, until ``commfuse.backends.release``), and what it logs then."""

from __future__ import annotations

import logging
import types

import torch

from commfuse import ops
from commfuse.fused.matmul import native_kernel
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
    from commfuse.planning.calls import resolve_call

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


def test_auto_logs_its_choice_at_debug_on_a_signatures_first_call_only(caplog, monkeypatch):
    from commfuse import backends

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    backends.release()
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with caplog.at_level(logging.DEBUG, logger="commfuse"):
        ops.all_gather_matmul(a, b)  # no process group: world size 1
    said = [r for r in caplog.records if r.name == "commfuse" and r.getMessage().startswith("auto chose")]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].levelno == logging.DEBUG
    message = said[0].getMessage()
    assert message.startswith("auto chose vanilla for all_gather: world size 1"), message
    assert "ring hop 128 bytes" in message and "flops per shard 192" in message, message  # 4x8 fp32; 2*32*3
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="commfuse"):
        ops.all_gather_matmul(a, b)  # the same signature: planned already, nothing said
        ops.all_gather_matmul(a, b)
    assert not [r for r in caplog.records if r.name == "commfuse"]
    backends.release()


def test_auto_logs_the_inputs_it_decided_on(caplog, monkeypatch):
    from commfuse import backends
    from commfuse.planning.calls import resolve_call

    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    backends.release()
    backend = _Backend(name="no-such-backend", device=torch.device("cpu"),
                       capabilities=Capabilities(overlap=True, auto_min_slice_bytes=4096), rank=0, world_size=8)
    with caplog.at_level(logging.DEBUG, logger="commfuse"):
        resolve_call(Collective.REDUCE_SCATTER, "auto", backend=backend, slice_bytes=8192, flops=1e9)
        resolve_call(Collective.REDUCE_SCATTER, "auto", backend=backend, slice_bytes=1024, flops=1e9)
        resolve_call(Collective.REDUCE_SCATTER, "auto", backend=backend, slice_bytes=8192, flops=1e9)  # memo hit
    short = [r.getMessage() for r in caplog.records if r.name == "commfuse" and r.levelno == logging.INFO]
    assert short == ["auto: reduce_scatter takes ring on 8 ranks: a ring hop carries 8192 bytes: each of the 7 hops "
                     "hides behind one shard of compute",
                     "auto: reduce_scatter takes vanilla on 8 ranks: a ring hop would carry 1024 bytes, under 4096: "
                     "per-step latency would outweigh the overlap, so one collective is cheaper"], short
    messages = [r.getMessage() for r in caplog.records if r.name == "commfuse" and r.levelno == logging.DEBUG]
    assert len(messages) == 2, messages
    ring, vanilla = messages
    assert ring.startswith("auto chose ring for reduce_scatter: a ring hop carries 8192 bytes"), ring
    assert vanilla.startswith("auto chose vanilla for reduce_scatter: a ring hop would carry 1024 bytes, under 4096")
    for text in (ring, vanilla):
        assert "world size 8" in text and "'no-such-backend'" in text and "overlap=True" in text, text
        assert "auto_min_slice_bytes=4096" in text and "flops per shard 1e+09" in text, text
        assert "hardware model: no profile applies" in text and "not in the planning table" in text, text
    backends.release()


def test_the_library_adds_no_handler_but_a_null_one():
    import commfuse

    handlers = logging.getLogger(commfuse.__name__).handlers
    assert handlers and all(type(h) is logging.NullHandler for h in handlers)


def test_auto_logs_when_it_takes_a_backends_native_kernel(caplog):
    caps = Capabilities(overlap=True, native_fused_ops=("all_gather_matmul",))
    backend = _Backend(name="fused-vendor", capabilities=caps, rank=0, world_size=2,
                       native_op=lambda op, **signature: (lambda *tensors: tensors, "shapes fit the fused kernel"))
    said: dict = {}
    with caplog.at_level(logging.DEBUG, logger="commfuse"):
        runner, fallback = native_kernel(backend, "all_gather_matmul", "auto", said)
    assert runner is not None and fallback == "auto" and said["algorithm"] == "native"
    (message,) = [r.getMessage() for r in caplog.records if r.name == "commfuse"]
    assert message.startswith("auto chose native for all_gather_matmul: shapes fit the fused kernel"), message
    assert "world size 2" in message and "'fused-vendor'" in message, message
