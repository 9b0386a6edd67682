"""Ranks that agree before they act, for the layers and styles: the exchange itself
(:func:`commfuse.planning.agreement.agree` and :func:`~commfuse.planning.agreement.share`, numbered and bounded
by commfuse's timeout) and :func:`structure`, what a module is made of, as decisions the ranks compare."""

from __future__ import annotations

from torch import nn

from commfuse.planning.agreement import agree, share
from commfuse.runtime.groups import register_format

__all__ = ["agree", "share", "structure"]


def structure(module: nn.Module) -> list[tuple[str, str]]:
    """What ``module`` is made of, as ``(name, value)`` pairs for :func:`agree`: each submodule's class and
    ``extra_repr()`` (a linear's features and bias, a norm's size and eps, a dropout's p, an activation's
    approximation), each parameter's and buffer's dtype and shape (and a frozen parameter, as such)."""
    items = []
    for path, child in module.named_modules():
        items.append((f"'{path}'" if path else "the module", f"{type(child).__name__}({child.extra_repr()})"[:200]))
    for path, p in module.named_parameters():
        items.append((f"'{path}'", f"{str(p.dtype).removeprefix('torch.')} {list(p.shape)}"
                                   + ("" if p.requires_grad else ", frozen")))
    for path, b in module.named_buffers():
        items.append((f"'{path}'", f"buffer {str(b.dtype).removeprefix('torch.')} {list(b.shape)}"))
    return items


register_format("tp.apply", lambda v: "commfuse.tp's agreement of the ranks on a style they apply")
