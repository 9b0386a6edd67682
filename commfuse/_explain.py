"""``commfuse.explain(model)``: every place commfuse runs in a model, and what it took there.

A *site* is a module a ``commfuse.tp`` style was applied to, or a
``commfuse.nn`` layer (a ``ParallelMLP``'s two linears are two sites). For
each, in the model's module order: its path, its kind, its group (the mesh
dim's name where it has one, and the global ranks), its world size, the
algorithm it was given and, once it has run a forward in eager mode, what
that algorithm took for each collective and ring hop size, and why; and each
place where a style moved an activation through DTensor instead of a fused
op, and why. The paths are those of ``model``, without the names torch's
wrappers add (``_orig_mod``, ``_checkpoint_wrapped_module``). A site is named
the same way at its first forward without this (``commfuse.runtime.sites``);
calling it names the sites by ``model``'s paths from then on.

Functional ops called from a module of the user's own are not sites (the ops
log what ``auto`` took per signature); a compiled model records nothing on
its sites (see ``commfuse.runtime.sites``).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from commfuse.errors import CommfuseTypeError
from commfuse.runtime import sites

__all__ = ["Explanation", "SiteReport", "explain"]


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """One site of a model, as :func:`explain` found it."""

    path: str
    kind: str
    group: str
    world_size: int
    algorithm: str
    #: (collective, ring hop bytes, algorithm taken, why), in the order first seen; empty until a forward ran.
    #: The hop bytes are 0 where a named algorithm needed none to be decided.
    taken: tuple[tuple[str, int, str, str], ...]
    #: why an activation went through DTensor instead of a fused op, once each
    fallbacks: tuple[str, ...]
    #: whether a forward of the site has completed (in eager mode): a site that ran and took nothing had
    #: nothing to communicate in its forward (a column-parallel linear given a replicated input)
    ran: bool = False


class Explanation(list):
    """The :class:`SiteReport` of every site of a model; ``str()`` is a table for people."""

    def __str__(self) -> str:
        if not self:
            return ("no commfuse site in this model (no module has a commfuse.tp style applied, and none is a "
                    "commfuse.nn layer)")
        lines = []
        for s in self:
            lines.append(f"{s.path}: {s.kind} on {s.group}, world size {s.world_size}, algorithm {s.algorithm!r}")
            if not s.taken and not s.fallbacks:
                lines.append("    took: nothing to communicate in its forward (its input was replicated: nothing to "
                             "fuse)" if s.ran else "    took: nothing yet (no forward has run in eager mode)")
            for collective, hop, name, why in s.taken:
                lines.append(f"    {collective}{f', {hop} bytes per hop' if hop else ''}: took {name} ({why})")
            for why in s.fallbacks:
                lines.append(f"    through DTensor: {why}")
        return "\n".join(lines)


def explain(model: nn.Module) -> Explanation:
    """Every commfuse site in ``model``, by module path (see the module docstring)."""
    if not isinstance(model, nn.Module):
        raise CommfuseTypeError(f"commfuse.explain takes an nn.Module, got {type(model).__name__}")
    out = Explanation()
    for path, module in sites.module_paths(model):
        site = sites.site_of(module)
        if site is None:
            continue
        site.path = path or "(the model itself)"
        out.append(SiteReport(
            path=site.path, kind=site.kind, group=_group_text(site.group, module), world_size=site.world_size,
            algorithm=str(site.algorithm),
            taken=tuple((c, hop, name, why) for (c, hop), (name, why) in site.taken.items()),
            fallbacks=tuple(site.fallbacks), ran=site.seen != -1))
    return out


def _group_text(group, module) -> str:
    """A site's group for people: the mesh dim's name and its global ranks, or a group's ranks."""
    import torch.distributed as dist

    from commfuse.nn._common import is_mesh

    mesh = group if is_mesh(group) else getattr(module, "_mesh", None)
    if is_mesh(mesh):
        names = mesh.mesh_dim_names
        ranks = mesh.mesh.flatten().tolist()
        return f"mesh dim {names[0]!r} (ranks {ranks})" if names else f"a 1-D mesh (ranks {ranks})"
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return f"the default group (ranks 0..{dist.get_world_size() - 1})"
        return "no group (a single process)"
    try:
        return f"group of ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # noqa: BLE001 - a destroyed group, or an object of a test's
        return repr(group)
