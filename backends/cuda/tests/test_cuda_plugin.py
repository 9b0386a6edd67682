"""Tier (a), no processes: the cuda plugin registers, wins over the generic accelerator path, and says
truthfully why it cannot run on this CPU-only machine; every verdict of its check is pinned."""

from __future__ import annotations

import torch

import commfuse as cf
from commfuse_cuda.plugin import Facts, decide, probe

GOOD = Facts("2.13.0", "12.8", True, True, 8, "NVIDIA H100 80GB HBM3", "2.27.5")


def test_registered_through_the_entry_point():
    spec = cf.backends.spec("cuda")
    assert spec.distribution == "commfuse-cuda"
    assert spec.device_types == ("cuda",)
    assert spec.priority > cf.backends.spec("accelerator").priority
    caps = spec.capabilities
    assert caps.streams and caps.overlap and caps.bidirectional_links and caps.execution == "eager"
    assert caps.native_fused_ops == ("all_gather_matmul", "matmul_reduce_scatter")
    assert caps.capturable  # commfuse.graphs.capture and the conformance suite's capture tier act on it


def test_probe_reads_this_machine():
    facts = probe()
    assert facts.torch_version == torch.__version__
    assert facts.torch_cuda == torch.version.cuda
    assert facts.device_count == (torch.cuda.device_count() if torch.version.cuda else 0)


def test_availability_here_is_the_probe_decided():
    avail = cf.backends.availability("cuda")
    assert avail == decide(probe())
    if torch.version.cuda is None:  # this project's machines
        assert not avail.ok
        assert avail.reason == f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
        assert "CUDA build of torch" in avail.fix


def test_every_verdict():
    assert decide(GOOD).ok
    assert decide(GOOD).detail == "8 CUDA device(s) (NVIDIA H100 80GB HBM3) with NCCL 2.27.5, CUDA 12.8"
    cases = {
        Facts("2.13.0", None, True, False, 0): "CPU-only build",
        Facts("2.13.0", "12.8", False, False, 1): "without torch.distributed",
        Facts("2.13.0", "12.8", True, False, 1): "has no NCCL backend",
        Facts("2.13.0", "12.8", True, True, 0): "no CUDA device is visible",
    }
    for facts, reason in cases.items():
        avail = decide(facts)
        assert not avail.ok and reason in avail.reason and avail.fix, (facts, avail)
    assert "CUDA_VISIBLE_DEVICES" in decide(Facts("2.13.0", "12.8", True, True, 0)).fix


def test_conformance_capabilities_file_loads():
    from commfuse.testing import Capabilities

    caps = Capabilities.load("commfuse_cuda.conformance:Capabilities")
    assert (caps.device, caps.dist_backend) == ("cuda", "nccl")


def test_every_declared_native_op_is_answered_by_native_op():
    """native_fused_ops is a promise: commfuse.ops asks native_op about each entry, and gets a real answer (here,
    on a CPU device, the reason it does not qualify), never "no kernel"."""
    import pytest

    from commfuse.errors import PluginError
    from commfuse.plugins import Capabilities
    from commfuse.plugins.types import NATIVE_FUSED_OPS
    from commfuse_cuda.backend import CudaBackend
    from commfuse_cuda.plugin import CAPABILITIES

    assert set(CAPABILITIES.native_fused_ops) <= set(NATIVE_FUSED_OPS)
    be = CudaBackend.__new__(CudaBackend)  # no process group: the environment half says why not
    be.world_size, be.group, be.device, be.enable_native = 2, None, torch.device("cpu"), True
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    signatures = {
        "all_gather_matmul": dict(a_shard=a, bs=[b], gather_dim=0, return_gathered=False, gathered_size=None,
                                  group=None),
        "matmul_reduce_scatter": dict(a=a, b=b, scatter_dim=0, reduce_op="sum", group=None),
    }
    for op in CAPABILITIES.native_fused_ops:
        runner, reason = be.native_op(op, **signatures[op])
        assert runner is None and reason.startswith("tensors are on 'cpu'"), (op, reason)
    assert be.native_op("all_to_all_consume") == (None, "commfuse-cuda has no native kernel for 'all_to_all_consume'")
    with pytest.raises(PluginError, match="native_fused_ops entries must be among .* got 'attention'"):
        Capabilities(native_fused_ops=("all_gather_matmul", "attention"))
