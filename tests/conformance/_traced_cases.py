"""Rank bodies for test_traced_tier.py: the traced tier's problems run eagerly on gloo ranks."""

from __future__ import annotations

#: The ops whose eager form is not differentiable itself (the layers build their backward from it).
NOT_DIFFERENTIABLE = ("all_gather_consume", "all_to_all_consume")


def eager(rank: int, n: int, names: list[str]) -> dict:
    """Every traced case in ``names``, this rank's body called eagerly on its own arguments: ``{case: (output,
    gradients or None)}``, the gradients of <output, this rank's cotangent> as the suite asks a runner for, as
    float64 numpy arrays (tensors through the launcher's queue would be shared memory that the rank takes with
    it when it ends)."""
    import torch

    from commfuse.testing import traced

    out = {}
    for name in names:
        p = traced.prepare(name, n)
        differentiable = not any(f"-{op}-" in f"-{name}-" for op in NOT_DIFFERENTIABLE)
        args = [arg[rank].clone().requires_grad_(differentiable) for arg in p.problem.inputs]
        y = p.problem.body(*args)
        grads = None
        if differentiable:
            grads = [g.double().numpy() for g in
                     torch.autograd.grad((y.double() * p.cotangents[rank].double()).sum(), args)]
        out[name] = (y.detach().double().numpy(), grads)
    return out
