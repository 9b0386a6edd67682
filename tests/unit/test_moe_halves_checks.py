"""The two halves of MoE's exchange (``commfuse.nn.moe.dispatch_experts`` / ``experts_combine``) refuse operands
of the wrong shape or of two dtypes by name, before any call on the group (one process, no process group)."""

from __future__ import annotations

import pytest
import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.nn import moe

COUNTS = torch.zeros(1, 2, dtype=torch.long)


@pytest.mark.parametrize(("call", "error", "text"), [
    (lambda: moe.dispatch_experts(torch.zeros(4, 8), torch.zeros(2, 8, 5), COUNTS), CommfuseValueError,
     "dispatch_experts: rank 0: xs must be (rows, hidden) and w13 (local experts, hidden, 2 * ffn), got [4, 8] and "
     "[2, 8, 5]"),
    (lambda: moe.dispatch_experts(torch.zeros(4, 8, dtype=torch.float64), torch.zeros(2, 8, 6), COUNTS),
     CommfuseTypeError, "dispatch_experts: rank 0: xs is torch.float64 and w13 is torch.float32; cast one"),
    (lambda: moe.experts_combine(torch.zeros(4, 8), torch.zeros(2, 7, 5), COUNTS, COUNTS), CommfuseValueError,
     "experts_combine: rank 0: acts must be (rows arrived, ffn) and w2 (local experts, ffn, hidden), got [4, 8] and "
     "[2, 7, 5]"),
    (lambda: moe.experts_combine(torch.zeros(4, 8, dtype=torch.float64), torch.zeros(2, 8, 5), COUNTS, COUNTS),
     CommfuseTypeError, "experts_combine: rank 0: acts is torch.float64 and w2 is torch.float32; cast one"),
])
def test_a_half_refuses_bad_operands_by_name(call, error, text):
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == text
