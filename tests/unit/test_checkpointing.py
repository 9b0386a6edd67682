"""Tier (a), no processes: what activation checkpointing needs from commfuse's runtime and autograd
(``commfuse.runtime.checkpointing``, ``commfuse.autograd.Replay``), on torch's own checkpointing."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from commfuse.autograd import Replay, recomputed
from commfuse.runtime import checkpointing


class _Seen(TorchDispatchMode):
    """A dispatch mode of the user's: it must stay on, in its place, whatever commfuse sets aside."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_selective_modes_are_set_aside_and_put_back_in_their_place():
    below, above = _Seen(), _Seen()
    caching = _CachingTorchDispatchMode(lambda *a, **k: CheckpointPolicy.MUST_SAVE, {})
    with below, caching, above:
        stack = _get_current_dispatch_mode_stack()
        assert checkpointing.as_custom_op() and checkpointing.depth() == 3
        aside = checkpointing.set_aside(checkpointing.depth())
        assert _get_current_dispatch_mode_stack() == [below, above]  # the user's modes stay, in their order
        assert not checkpointing.as_custom_op()
        torch.ones(2).add(1)
        checkpointing.put_back(aside)
        assert _get_current_dispatch_mode_stack() == stack
    assert torch.ops.aten.add.Tensor in below.ops and torch.ops.aten.add.Tensor in above.ops


def test_nothing_is_set_aside_without_selective_modes():
    with _Seen():
        assert checkpointing.set_aside(checkpointing.depth()) is None
        assert not checkpointing.as_custom_op()
    assert checkpointing.depth() == 0


def test_an_atomic_op_is_hidden_from_the_policy_and_recomputed_whole():
    # a policy that saves every op it sees; the atomic function's own ops are never among them, in the forward
    # or the recompute, so a recompute runs them again (they would be handed the forward's outputs otherwise)
    calls = []

    @checkpointing.atomic
    def fused(x):
        calls.append(1)
        return (x * 2).sin()

    seen = []

    def policy(ctx, func, *args, **kwargs):
        seen.append(func)
        return CheckpointPolicy.MUST_SAVE

    x = torch.randn(4, requires_grad=True)
    y = checkpoint(lambda t: fused(t.cos()).exp(), x, use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts(policy))
    y.sum().backward()
    assert torch.ops.aten.mul.Tensor not in seen and torch.ops.aten.sin.default not in seen, seen
    assert torch.ops.aten.cos.default in seen and torch.ops.aten.exp.default in seen, seen
    assert len(calls) == 2  # forward and recompute
    want = x.detach().clone().requires_grad_()
    (want.cos() * 2).sin().exp().sum().backward()
    assert torch.equal(x.grad, want.grad)


def test_a_recompute_is_told_from_a_forward_and_names_its_region():
    seen = {}
    state = object()

    def region(t):
        found = checkpointing.hooks()
        kind = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
        seen[kind] = checkpointing.lane_of(state, ("autograd" if kind == "recompute" else "MainThread", 7), 5,
                                           found)
        seen[f"{kind}-recomputing"] = checkpointing.recomputing()
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen["forward"] == ("MainThread", 7) and not seen["forward-recomputing"]
    name, code = seen["recompute"]
    assert name == "autograd, recomputing the checkpointed region of call #5" and code != 7, seen
    assert seen["recompute-recomputing"]
    assert checkpointing.hooks() is None


def test_torch_ending_a_recompute_early_is_recognised():
    from torch.utils.checkpoint import _StopRecomputationError

    assert checkpointing.stopped(_StopRecomputationError())
    assert not checkpointing.stopped(RuntimeError("stop"))


def test_apart_runs_without_the_region_around_it():
    inside = {}

    def region(t):
        with checkpointing.apart():
            inside["hooks"] = checkpointing.hooks()
        inside["after"] = checkpointing.hooks()
        return t.sin()

    checkpoint(region, torch.randn(2, requires_grad=True), use_reentrant=False).sum().backward()
    assert inside["hooks"] is None and inside["after"] is not None


def test_replay_makes_a_partial_again_with_the_forwards_random_numbers_and_autocast():
    x = torch.randn(8, 8)

    def producer(d, t):
        return torch.nn.functional.dropout(t @ t, p=0.5, training=True) * (d + 1)

    replay = Replay((x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        made = [replay.record(d, producer, (x,)) for d in range(3)]
    torch.rand(100)  # the global stream moves on
    state = torch.get_rng_state()
    again = [replay.replay(d, producer, (x,)) for d in (2, 0, 1)]
    assert torch.equal(torch.get_rng_state(), state)  # replaying leaves the global stream where it was
    for d, got in zip((2, 0, 1), again):
        assert got.dtype == torch.bfloat16 and torch.equal(got, made[d]), d


def test_saved_tensor_hooks_are_seen():
    assert not recomputed()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert recomputed()
    assert not recomputed()


def test_cached_mode_is_one_of_the_selective_kinds():
    assert _CachedTorchDispatchMode in checkpointing._kinds() and _CachingTorchDispatchMode in checkpointing._kinds()
