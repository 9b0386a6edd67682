"""Tier (a), no processes: the npu plugin registers and reports the real reason it cannot run here
(torch_npu is not importable in this environment), every other verdict of its check is pinned, and the
CANN library search looks where the loader would, on a real file system."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

import commfuse as cf
from commfuse_npu.plugin import DEFAULT_CANN, Facts, decide, find_libhccl, probe

LIB = "/opt/cann/lib64/libhccl.so"


def test_registered_through_the_entry_point():
    spec = cf.backends.spec("npu")
    assert spec.distribution == "commfuse-npu"
    assert spec.device_types == ("npu",)
    assert spec.priority > cf.backends.spec("accelerator").priority
    assert spec.capabilities.native_fused_ops == ("all_gather_matmul", "matmul_reduce_scatter")
    assert spec.capabilities.capturable  # through torch.npu.NPUGraph; the capture tier checks it on an NPU


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_the_reason_here_is_that_torch_npu_is_not_importable():
    avail = cf.backends.availability("npu")
    assert not avail.ok
    assert avail.reason == "torch_npu is not importable in this environment (no module named 'torch_npu')"
    assert f"pip install torch-npu=={torch.__version__.split('+')[0]}" in avail.fix
    assert "never install torch-npu where CANN is missing" in avail.fix
    # The check must not have imported it (it would break torch without CANN).
    assert "torch_npu" not in sys.modules
    with pytest.raises(cf.CommfuseError, match="backend 'npu'.*cannot run here: torch_npu is not importable"):
        cf.backends.get("npu")


def test_probe_is_the_truth_here():
    facts = probe()
    assert facts.torch_npu_found == (importlib.util.find_spec("torch_npu") is not None)
    assert facts.torch_version == torch.__version__


def test_every_verdict():
    cases = [
        (Facts("2.13.0", False, None), "torch_npu is not importable", "pip install torch-npu==2.13.0"),
        (Facts("2.13.0", True, None, ("/a/lib64", f"{DEFAULT_CANN}/lib64")),
         f"CANN's libhccl.so is missing (looked in /a/lib64, {DEFAULT_CANN}/lib64)", "set_env.sh"),
        (Facts("2.13.0", True, LIB, (), "ImportError: libascendcl.so: cannot open shared object file"),
         "import torch_npu fails with torch 2.13.0: ImportError: libascendcl.so", "CANN"),
        (Facts("2.13.0", True, LIB, (), "", 0), "no NPU is visible", "npu-smi info"),
        (Facts("2.13.0", True, LIB, (), "", 8, False), "no 'hccl' backend", "reinstall torch-npu"),
    ]
    for facts, reason, fix in cases:
        avail = decide(facts)
        assert not avail.ok and reason in avail.reason and fix in avail.fix, avail
    ok = decide(Facts("2.13.0", True, LIB, (), "", 8, True, "Ascend910B3"))
    assert ok.ok and ok.detail == f"8 NPU(s) (Ascend910B3) with HCCL ({LIB})"


def test_libhccl_search_order_on_disk(tmp_path):
    home, ld, other = tmp_path / "toolkit", tmp_path / "ld", tmp_path / "other"
    for d in (home / "lib64", ld, other):
        d.mkdir(parents=True)
    env = {"ASCEND_HOME_PATH": str(home), "LD_LIBRARY_PATH": f"{ld}:{other}:{ld}"}
    path, searched = find_libhccl(env)
    assert path is None
    assert searched == (str(home / "lib64"), str(ld), str(other), os.path.join(DEFAULT_CANN, "lib64"))
    (other / "libhccl.so").write_bytes(b"")
    assert find_libhccl(env)[0] == str(other / "libhccl.so")
    (home / "lib64" / "libhccl.so").write_bytes(b"")  # ASCEND_HOME_PATH comes first
    assert find_libhccl(env)[0] == str(home / "lib64" / "libhccl.so")
    assert find_libhccl({"ASCEND_TOOLKIT_HOME": str(home)})[0] == str(home / "lib64" / "libhccl.so")


def test_conformance_capabilities_file_loads():
    from commfuse.testing import Capabilities

    caps = Capabilities.load("commfuse_npu.conformance:Capabilities")
    assert (caps.device, caps.dist_backend) == ("npu", "hccl")


def test_every_declared_native_op_is_answered_by_native_op():
    """native_fused_ops is a promise: commfuse.ops asks native_op about each entry and gets a real answer (here,
    on a CPU device, the reason MC2 does not apply), and torch_npu stays unimported."""
    from commfuse.plugins.types import NATIVE_FUSED_OPS
    from commfuse_npu.backend import NpuBackend
    from commfuse_npu.plugin import CAPABILITIES

    assert set(CAPABILITIES.native_fused_ops) <= set(NATIVE_FUSED_OPS)
    be = NpuBackend.__new__(NpuBackend)  # no process group: the environment says why not
    be.world_size, be.group, be.device = 2, None, torch.device("cpu")
    a, b = torch.zeros(4, 256, dtype=torch.float16), torch.zeros(256, 8, dtype=torch.float16)
    signatures = {
        "all_gather_matmul": dict(a_shard=a, bs=[b], gather_dim=0, return_gathered=False, gathered_size=None,
                                  group=None),
        "matmul_reduce_scatter": dict(a=a, b=b, scatter_dim=0, reduce_op="sum", group=None),
    }
    for op in CAPABILITIES.native_fused_ops:
        assert be.native_op(op, **signatures[op]) == (None, "tensors are on 'cpu'; MC2 kernels run on Ascend NPUs")
    assert be.native_op("all_to_all_consume")[0] is None
    if importlib.util.find_spec("torch_npu") is None:
        assert "torch_npu" not in sys.modules
