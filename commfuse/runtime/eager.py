"""Code that torch.compile must run, never trace: the executor and call resolution.

When a compiled region falls back to eager for one call (a graph break:
``fullgraph=False`` and a commfuse form that is not an op, such as
``all_gather_consume``), Dynamo still tries to compile every Python frame
that call runs. The ring's frames talk to a process group (``send``,
``recv``, ``Work.wait``), which Dynamo cannot trace and fails on inside its
own machinery instead of breaking the graph. Marking their code objects
"skip, and skip everything they call" (Dynamo's frame execution strategy;
the same marking ``torch._dynamo.eval_frame.skip_code`` makes, with the
recursive action as well) runs them as plain Python, as eager mode does.
Compiled graphs never reach these frames: they call ``torch.ops.commfuse``
(``commfuse.library``), whose kernels run outside Dynamo.
"""

from __future__ import annotations

from collections.abc import Callable


def eager_only(*functions: Callable) -> None:
    """Mark ``functions`` (and whatever they call) as never compiled by Dynamo; a no-op on a torch without the
    hook (the marking is an optimisation of the fallback, not a requirement of eager mode)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # pragma: no cover - older or newer torch without the C hook
        return
    for fn in functions:
        code = getattr(fn, "__code__", None)
        if code is not None:
            set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
