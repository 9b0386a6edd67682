"""The plugin record: how commfuse finds this backend, checks it can run, and makes one.

Keep this module cheap: commfuse imports it whenever it lists backends. Import
torch and your device runtime inside ``check`` and ``factory`` only.
"""

from __future__ import annotations

from collections.abc import Iterator

from commfuse.plugins import Availability, BackendSpec, Capabilities, hookimpl

#: Rename to your device's name (a lowercase identifier); also in tests/conftest.py.
NAME = "template"

CAPABILITIES = Capabilities(
    bidirectional_links=True,  # both directions of a link usable at once
    native_fused_ops=(),  # e.g. ("all_gather_matmul",) once you lower ops to fused kernels
    execution="eager",  # "traced" if post() builds a graph instead of moving data (see backends/xla)
    streams=False,  # True if transfers run on their own device stream
    overlap=True,  # gloo progresses transfers in its own threads while the host computes
    # auto without a profile: vanilla for ring hops under this many bytes (None: 64 KiB). Compare ring and
    # vanilla with `commfuse bench --preset tiny` on your hardware before lowering it.
    auto_min_slice_bytes=None,
)


def check() -> Availability:
    """Whether the backend can run here; when not, say why and how to fix it (never raise)."""
    import torch.distributed as dist

    # Replace with your probes: runtime importable, driver libraries present, a device visible.
    if not dist.is_available() or not dist.is_gloo_available():
        return Availability.no(
            "torch.distributed with gloo is not available in this torch build",
            "install a torch build with torch.distributed, e.g. pip install torch==2.13.0",
        )
    return Availability.yes("cpu tensors through torch.distributed gloo (the template's stand-in transport)")


def factory(group=None, device=None):
    from commfuse_template.backend import TemplateBackend

    return TemplateBackend(group=group, device=device)


@hookimpl
def commfuse_backends() -> Iterator[BackendSpec]:
    yield BackendSpec(
        name=NAME,
        device_types=("cpu",),  # your torch device type, e.g. ("mydevice",)
        capabilities=CAPABILITIES,
        check=check,
        factory=factory,
        description="skeleton for new hardware (delegates to gloo on CPU); copy backends/_template to start",
        # Below the built-in gloo (0), so the template never wins for plain CPU tensors.
        priority=-20,
        install_hint="pip install -e backends/_template",
    )
