"""Tier (a), no processes: commfuse.ep's gradient norm on plain tensors is torch's. Its norm over parameters on
several meshes is tested on gloo ranks (tests/distributed/test_moe_model_gloo.py)."""

from __future__ import annotations

import math

import pytest
import torch

from commfuse import ep
from commfuse.errors import CommfuseValueError


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((3, 4), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: left out, as torch leaves it
    return params


@pytest.mark.parametrize("norm_type", (2.0, 1.0, 3.0, math.inf))
def test_the_total_norm_of_plain_tensors_is_torchs(norm_type):
    grads = [p.grad for p in _params() if p.grad is not None]
    want = torch.nn.utils.get_total_norm(grads, norm_type)
    torch.testing.assert_close(ep.total_norm(grads, norm_type), want)


@pytest.mark.parametrize("max_norm", (0.5, 1e6))
@pytest.mark.parametrize("foreach", (None, False))
def test_clipping_plain_parameters_is_torchs(max_norm, foreach):
    mine, theirs = _params(), _params()
    got = ep.clip_grad_norm_(mine, max_norm, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
    torch.testing.assert_close(got, want)
    for a, b in zip(mine, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    if max_norm < want:  # the clipped gradients' norm is the bound
        torch.testing.assert_close(ep.total_norm([p.grad for p in mine if p.grad is not None]),
                                   torch.tensor(max_norm), rtol=1e-5, atol=0)


def test_a_nonfinite_norm_is_named_when_asked_and_returned_otherwise():
    params = _params()
    params[0].grad[0, 0] = float("inf")
    with pytest.raises(CommfuseValueError, match="total norm of order 2.0 of the gradients is inf"):
        ep.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert math.isinf(ep.clip_grad_norm_(params, 1.0).item())


def test_no_gradient_has_norm_zero():
    p = torch.nn.Parameter(torch.ones(3))
    assert ep.clip_grad_norm_([p], 1.0).item() == 0.0 and p.grad is None
    assert ep.total_norm([]).item() == 0.0
