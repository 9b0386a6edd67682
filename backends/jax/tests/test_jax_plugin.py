"""Tier (a), no processes, any environment: the jax backend's record, capabilities and availability, without
importing jax or torchax; commfuse's resolution of a backend that runs ops whole."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from commfuse.errors import PluginError
from commfuse.plugins import Capabilities
from commfuse_jax import plugin
from commfuse_jax.capabilities import CAPABILITIES


def test_the_record_imports_neither_jax_nor_torchax():
    for name in ("jax", "torchax"):
        if name in sys.modules:
            pytest.skip(f"{name} was imported by another test of this session")
    plugin.check()
    list(plugin.commfuse_backends())
    assert "jax" not in sys.modules and "torchax" not in sys.modules


def test_availability_tells_the_truth_about_this_environment():
    verdict = plugin.check()
    have = all(importlib.util.find_spec(n) is not None for n in ("jax", "torchax"))
    assert verdict.ok == have
    if not have:
        assert "not importable" in verdict.reason and "ci/setup_jax.sh" in verdict.fix


def test_capabilities_run_the_ops_whole_and_claim_no_measured_overlap():
    assert CAPABILITIES.execution == "traced" and not CAPABILITIES.overlap and not CAPABILITIES.capturable
    assert set(CAPABILITIES.whole_ops) == {"all_gather_matmul", "matmul_reduce_scatter", "all_gather_consume",
                                           "produce_reduce_scatter", "all_to_all_consume", "ring_attention"}


def test_whole_ops_are_refused_by_name_where_they_cannot_hold():
    with pytest.raises(PluginError, match="needs execution='traced'"):
        Capabilities(whole_ops=("all_gather_matmul",))
    with pytest.raises(PluginError, match="among .*got 'sharded_linear'"):
        Capabilities(execution="traced", whole_ops=("sharded_linear",))


def test_no_group_and_no_torch_distributed_takes_the_whole_op_backend_for_its_device():
    import commfuse.backends as backends

    if "jax" not in backends.available():
        pytest.skip("jax and torchax are not importable here")
    backends.release()
    be = backends.resolve(None, None, "jax:0")
    assert type(be).__name__ == "JaxBackend" and backends.whole_op(be, "ring_attention")
    assert backends.resolve(None, None, "cpu") is None  # a CPU tensor without a group is still world size 1
    backends.release()
