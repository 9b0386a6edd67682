"""Tier (a), no processes: the MC2 constraint checker accepts exactly the documented region of
npu_all_gather_base_mm / npu_mm_reduce_scatter_base, checked at every boundary, and refuses a second
communication domain; on CPU tensors the lowering declines with the reason. The kernels are UNVERIFIED."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from commfuse_npu.mc2 import (
    DomainTracker,
    Mc2Request,
    environment,
    mc2_verdict,
    product_family,
    request_for,
    signature_verdict,
    x2_layout,
)

AG = Mc2Request("all_gather_matmul", (128, 512), (512, 64), "bfloat16", "bfloat16", 8, "A2")
RS = Mc2Request("matmul_reduce_scatter", (128, 512), (512, 64), "float16", "float16", 8, "A2")


def v(base, **changes):
    return mc2_verdict(dataclasses.replace(base, **changes))


def test_the_documented_examples_qualify():
    assert v(AG) and "npu_all_gather_base_mm" in v(AG).reason
    assert v(RS) and "npu_mm_reduce_scatter_base" in v(RS).reason


@pytest.mark.parametrize("base", [AG, RS], ids=["ag", "rs"])
@pytest.mark.parametrize("k, ok", [(255, False), (256, True), (4096, True), (65534, True), (65535, False), (70000, False)])
def test_k_range_boundaries(base, k, ok):
    got = v(base, x1_shape=(128, k), x2_shape=(k, 64))
    assert bool(got) is ok, got
    if not ok:
        assert f"k = {k} is outside [256, 65535)" in got.reason


@pytest.mark.parametrize("base", [AG, RS], ids=["ag", "rs"])
@pytest.mark.parametrize(
    "family, n, ok",
    [("A2", 1, False), ("A2", 2, True), ("A2", 3, False), ("A2", 4, True), ("A2", 6, False), ("A2", 8, True),
     ("A2", 16, False), ("A2", 32, False), ("A3", 2, True), ("A3", 8, True), ("A3", 12, False), ("A3", 16, True),
     ("A3", 32, True), ("A3", 64, False), (None, 8, False)],
)
def test_world_sizes_per_product(base, family, n, ok):
    got = v(base, world_size=n, family=family, x1_shape=(64 * 32, 512))
    assert bool(got) is ok, got


@pytest.mark.parametrize("m, n, ok", [(8, 4, True), (6, 4, False), (4, 4, True), (2, 4, False), (96, 32, True), (80, 32, False)])
def test_reduce_scatter_m_must_divide(m, n, ok):
    got = v(RS, x1_shape=(m, 512), world_size=n, family="A3")
    assert bool(got) is ok, got
    if not ok:
        assert f"m = {m} is not divisible by the world size {n}" in got.reason


def test_all_gather_m_is_per_rank_and_need_not_divide():
    assert v(AG, x1_shape=(3, 512), world_size=8)


@pytest.mark.parametrize(
    "base, changes, reason",
    [
        (AG, dict(x1_shape=(2, 64, 512)), "2-D x1"),
        (RS, dict(x2_shape=(1, 512, 64)), "2-D x1"),
        (AG, dict(x2_shape=(256, 64)), "x1 has k = 512 but x2 has 256 rows"),
        (AG, dict(dtype="float32", x2_dtype="float32"), "dtype float32"),
        (RS, dict(dtype="int8", x2_dtype="int8"), "dtype int8"),
        (AG, dict(x2_dtype="float16"), "x2 has dtype float16 but x1 has bfloat16"),
        (AG, dict(bias=True), "does not support a bias"),
        (RS, dict(bias=True), "does not support a bias"),
        (AG, dict(x1_contiguous=False), "transposed"),
        (AG, dict(dim=1), "gathers along the rows (dim 0); asked for dim 1"),
        (RS, dict(dim=1), "scatters along the rows"),
        (RS, dict(reduce_op="avg"), "supports only 'sum'"),
        (AG, dict(requires_grad=True), "requires grad"),
        (AG, dict(gathered_evenly=False), "equal shards"),
        (AG, dict(op="all_to_all"), "no kernel for 'all_to_all'"),
    ],
)
def test_each_constraint_refuses_with_its_reason(base, changes, reason):
    got = v(base, **changes)
    assert not got and reason in got.reason, got


def test_dim_minus_two_is_the_rows():
    assert v(AG, dim=-2)


def test_product_family():
    assert product_family("Ascend910B3") == "A2"
    assert product_family("Ascend910B1") == "A2"
    assert product_family("Ascend910_9392") == "A3"
    assert product_family("Ascend910A") is None
    assert product_family("Ascend310P3") is None


def test_one_communication_domain():
    domains = DomainTracker()
    assert domains.admit("hccl_world_group")
    assert domains.admit("hccl_world_group")
    refused = domains.admit("tp_group_2")
    assert not refused and "'hccl_world_group' was used first, this call is on 'tp_group_2'" in refused.reason
    domains.reset()
    assert domains.admit("tp_group_2")


def test_request_from_tensors():
    x1 = torch.zeros(8, 512, dtype=torch.bfloat16)
    x2 = torch.zeros(64, 512, dtype=torch.bfloat16).t()  # a transposed x2 is allowed
    r = request_for("all_gather_matmul", x1, x2, world_size=4, family="A2", dim=-2)
    assert r == Mc2Request("all_gather_matmul", (8, 512), (512, 64), "bfloat16", "bfloat16", 4, "A2", dim=0)
    assert mc2_verdict(r)
    r = request_for("all_gather_matmul", x1.t().contiguous().t(), x2, world_size=4, family="A2")
    assert not r.x1_contiguous and not mc2_verdict(r)
    with torch.enable_grad():
        assert request_for("matmul_reduce_scatter", x1.requires_grad_(), x2, world_size=4, family="A2").requires_grad


def test_cpu_tensors_decline_with_the_reason():
    verdict, family, hcom, n = environment(torch.device("cpu"), None)
    assert not verdict and verdict.reason == "tensors are on 'cpu'; MC2 kernels run on Ascend NPUs"
    assert (family, hcom, n) == (None, "", 1)


def h(*shape, grad=False):
    return torch.zeros(shape, dtype=torch.float16, requires_grad=grad)


def ag_sig(a, bs, gather_dim=0, gathered_size=None):
    return dict(a_shard=a, bs=bs, gather_dim=gather_dim, return_gathered=False, gathered_size=gathered_size,
                group=None)


def rs_sig(a, b, scatter_dim=0, reduce_op="sum"):
    return dict(a=a, b=b, scatter_dim=scatter_dim, reduce_op=reduce_op, group=None)


@pytest.mark.parametrize(
    "op, sig, ok, reason",
    [
        ("all_gather_matmul", ag_sig(h(8, 256), [h(256, 64)]), True, "npu_all_gather_base_mm: 4 x (8, 256)"),
        ("all_gather_matmul", ag_sig(h(8, 256), [h(256, 64)], gathered_size=32), True, "gathered"),
        ("all_gather_matmul", ag_sig(h(8, 256), [h(256, 64)], gathered_size=31), False, "equal shards"),
        ("all_gather_matmul", ag_sig(h(8, 256), [h(256, 64), h(256, 8)]), False, "the call has 2 weights"),
        ("all_gather_matmul", ag_sig(h(8, 256), [h(1024, 64)], gather_dim=1), False, "asked for dim 1"),
        ("all_gather_matmul", ag_sig(h(2, 8, 256), [h(256, 64)], gather_dim=1), False, "2-D x1"),
        ("all_gather_matmul", ag_sig(h(8, 256, grad=True), [h(256, 64)]), True, "gathered"),  # autograd: per call
        ("all_gather_matmul", ag_sig(h(8, 255), [h(255, 64)]), False, "k = 255 is outside"),
        ("all_gather_matmul", ag_sig(h(256, 8).t(), [h(256, 64)]), True, "gathered"),  # layout: the runner's
        ("matmul_reduce_scatter", rs_sig(h(8, 256), h(256, 64)), True, "summed and scattered over 4"),
        ("matmul_reduce_scatter", rs_sig(h(6, 256), h(256, 64)), False, "m = 6 is not divisible"),
        ("matmul_reduce_scatter", rs_sig(h(8, 256), h(256, 64), reduce_op="avg"), False, "supports only 'sum'"),
        ("matmul_reduce_scatter", rs_sig(h(8, 256), h(256, 64), scatter_dim=1), False, "scatters along the rows"),
        ("all_to_all_consume", {}, False, "no kernel for 'all_to_all_consume'"),
    ],
)
def test_signature_verdicts(op, sig, ok, reason):
    got = signature_verdict(op, sig, world_size=4, family="A2")
    assert bool(got) is ok and reason in got.reason, got


def test_x2_layout_keeps_what_mc2_takes_and_copies_the_rest():
    w = torch.zeros(256, 64)
    assert x2_layout(w) is w
    t = torch.zeros(64, 256).t()  # a transposed view: MC2 takes it as it is
    assert x2_layout(t) is t
    sliced = torch.zeros(256, 128)[:, :64]  # neither: copied
    got = x2_layout(sliced)
    assert got is not sliced and got.is_contiguous() and torch.equal(got, sliced)
