"""What a block style takes over: a block's parts read and checked before a style replaces its forward.

A block style (``commfuse.tp.AttentionParallel``, ``SwiGLUParallel``) computes a block's forward with its
own code. That is only right when the block computes nothing the style does not, so the style reads the
block first, with these helpers:

- :func:`unclaimed`: every parameter, buffer and submodule of the block that none of the parts the style
  computes with holds (what the style would silently drop);
- :func:`activation_name`: an activation module identified by what it computes (SiLU, GELU, GELU-tanh,
  ReLU), or None;
- :func:`per_head`: whether a norm module holds only per-head parameters (QK-norm over one head's features);
- :func:`is_transformers`, :func:`transformers_rope`: a HuggingFace transformers module, and its family's own
  rotary function (``apply_rotary_pos_emb`` of the module's modeling file);
- :func:`where`: the block named by its path in the model ``parallelize_module`` was given, where it can be
  found, else by its class;
- :func:`differs`: the relative difference of two outputs, for the style's check of its computation against
  the block's own forward on a small input.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "activation_name", "differs", "is_transformers", "per_head", "transformers_rope",
           "unclaimed", "where"]

#: the activations a feed-forward style computes, by name
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

#: the modules a block may hold that compute nothing (no parameters, the identity where they run)
_NOTHING = (nn.Identity,)


def activation_name(module: nn.Module) -> str | None:
    """The name in :data:`ACTIVATIONS` of what ``module`` computes, told by its values on a grid of points
    (-32..32) in float64: None for a module with parameters or buffers, or one that computes none of them
    (QuickGELU, ReLU², a clipped GELU...)."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    grid = torch.linspace(-32, 32, 1025, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = module(grid)
    except Exception:  # noqa: BLE001 - not an elementwise activation of one tensor
        return None
    if not isinstance(got, torch.Tensor) or got.shape != grid.shape:
        return None
    for name, fn in ACTIVATIONS.items():
        if torch.allclose(got, fn(grid), rtol=1e-6, atol=1e-6):
            return name
    return None


def per_head(norm: nn.Module, head_dim: int) -> bool:
    """Whether every parameter and buffer of ``norm`` is one value per feature of a head (``(head_dim,)``) or a
    scalar: a norm over one head's features, which each rank can apply to the heads it holds."""
    tensors = [*norm.parameters(), *norm.buffers()]
    return all(t.ndim == 0 or tuple(t.shape) == (head_dim,) for t in tensors)


def unclaimed(block: nn.Module, claimed: list[str], *, hook_reads_block: bool = False) -> list[str]:
    """The parts of ``block`` that none of the ``claimed`` submodules (paths in the block) holds, each as
    ``'path' (what it is)``: parameters and buffers outside them, and submodules that are neither claimed,
    inside a claimed one, nor a container of claimed ones only. An ``nn.Identity`` and an ``nn.Dropout`` with
    ``p=0`` compute nothing and pass. With ``hook_reads_block`` (a rope hook given the block) a submodule that
    holds no parameters and the block's own buffers are the hook's to read (a rotary module and its cache)."""
    claimed = [c for c in claimed if c]

    def inside(path: str) -> bool:
        return any(path == c or path.startswith(c + ".") for c in claimed)

    def above(path: str) -> bool:
        return any(c.startswith(path + ".") for c in claimed)

    found = []
    for path, child in block.named_modules():
        if not path or inside(path) or isinstance(child, _NOTHING):
            continue
        if isinstance(child, nn.Dropout) and child.p == 0:
            continue
        own_params = list(child.named_parameters(recurse=False))
        if above(path):
            found += [f"'{path}.{name}' (a parameter of the {type(child).__name__} that holds the projections)"
                      for name, _ in own_params]
            continue
        if any(path.startswith(p + ".") for p in found_paths(found)):
            continue
        if hook_reads_block and not any(True for _ in child.parameters()):
            continue
        what = f"a {type(child).__name__}"
        if isinstance(child, nn.Dropout):
            what += f" with p={child.p}"
        found.append(f"'{path}' ({what})")
    for name, _ in block.named_parameters(recurse=False):
        found.append(f"'{name}' (a parameter of the block itself)")
    if not hook_reads_block:
        for name, _ in block.named_buffers(recurse=False):
            found.append(f"'{name}' (a buffer of the block itself)")
    return found


def found_paths(found: list[str]) -> list[str]:
    """The paths of :func:`unclaimed`'s findings (``'path' (what)``)."""
    return [f.split("'")[1] for f in found if f.startswith("'")]


def is_transformers(block: nn.Module) -> bool:
    """Whether ``block`` is a HuggingFace transformers module (its class defined in a ``transformers.``
    module), whose conventions the styles read from it: keyword inputs, ``position_embeddings=(cos, sin)``,
    ``(output, attention weights)`` returned by attention."""
    return type(block).__module__.startswith("transformers.")


def transformers_rope(block: nn.Module):
    """The rotary function of ``block``'s transformers family, ``apply_rotary_pos_emb(q, k, cos, sin)`` of the
    file that defines its class (q, k as (batch, heads, seq, head_dim)), or None."""
    module = sys.modules.get(type(block).__module__)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    return fn if callable(fn) else None


def where(block: nn.Module) -> str:
    """``block`` named for an error: its path in the model given to ``parallelize_module`` and its class
    (``'model.layers.0.self_attn' (Qwen3Attention)``), or its class alone where the path cannot be found
    (``parallelize_module`` hands a style the submodule only: the path is read from the model it was called
    with, found among the callers' frames)."""
    cls = type(block).__name__
    path = _path(block)
    return f"{path!r} ({cls})" if path else cls


def _path(block: nn.Module) -> str | None:
    try:
        from torch.distributed.tensor.parallel import api

        code = api.parallelize_module.__code__
    except (ImportError, AttributeError):  # pragma: no cover - torch without tensor parallelism
        return None
    root = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            root = frame.f_locals.get("module", root)  # the outermost call's is the model
        frame = frame.f_back
    if not isinstance(root, nn.Module):
        return None
    for path, module in root.named_modules(remove_duplicate=False):
        if module is block:
            return path or None
    return None


def differs(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, in float64): how far a style's computation is from the
    block's own."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))
