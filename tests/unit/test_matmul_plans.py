"""Tier (a), one process: the fused matmul ops' planners take their options by keyword only, so a caller
cannot pass a row of positional ``True, None, None, None`` that silently lands in the wrong option."""

from __future__ import annotations

import pytest
import torch

from commfuse import backends
from commfuse.fused.all_gather_matmul import AllGatherMatmulPlan, plan_all_gather_matmul
from commfuse.fused.matmul_reduce_scatter import MatmulReduceScatterPlan, plan_matmul_reduce_scatter


def test_planners_refuse_options_by_position():
    backends.release()
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    with pytest.raises(TypeError, match="positional"):
        plan_all_gather_matmul(a, b, None, 0, "ring", False, None, True, None, None, None)
    with pytest.raises(TypeError, match="positional"):
        plan_matmul_reduce_scatter(a, b, None, 0, "sum", "ring", None, None, None)


def test_planners_by_keyword_plan_a_single_process():
    backends.release()
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    plan = plan_all_gather_matmul(a, b, group=None, gather_dim=0, algorithm="ring", return_gathered=False,
                                  gathered_size=None, keep_gathered=True)
    assert type(plan) is AllGatherMatmulPlan and plan.call is None and plan.one_weight_no_grad is None
    torch.testing.assert_close(plan(a, b), a @ b)
    plan = plan_matmul_reduce_scatter(a, b, group=None, scatter_dim=0, reduce_op="sum", algorithm="ring")
    assert type(plan) is MatmulReduceScatterPlan and plan.call is None and plan.plans == ()
    torch.testing.assert_close(plan(a, b), a @ b)
