"""The plugin record: how commfuse finds this backend, checks it can run, and makes one.

Keep this module cheap: commfuse imports it whenever it lists backends. Import
torch and your device runtime inside ``check`` and ``factory`` only.
"""

from __future__ import annotations

from collections.abc import Iterator

from commfuse.plugins import Availability, BackendSpec, Capabilities, hookimpl

#: Rename to your device's name (a lowercase identifier); also in tests/conftest.py.
NAME = "template"

# Each field is a promise that something in commfuse acts on (commfuse/plugins/types.py names the reader).
CAPABILITIES = Capabilities(
    # Both directions of a link usable at once. Nothing acts on it yet (auto's policy is meant to); say the truth.
    bidirectional_links=True,
    # Ops whose whole call your backend runs as one fused kernel, among ("all_gather_matmul",
    # "matmul_reduce_scatter"). commfuse.ops then asks your backend's native_op(op, **signature) once per call
    # signature for algorithm "native" or "auto" (see commfuse/runtime/protocol.py, and backends/cuda's
    # CudaBackend.native_op for an example). Leave it empty without native_op.
    native_fused_ops=(),
    # "traced" if post() builds a graph instead of moving data (see backends/xla): the executor then skips its
    # host-side fingerprint check.
    execution="eager",
    # True if waits are stream-ordered on your device (C10dBackend then waits without blocking the host and
    # hands the timeout to its watchdog). gloo on CPU blocks the host: False.
    streams=False,
    # Whole collectives you have, for the vanilla and sliced algorithms (default: all three); a missing one
    # makes those algorithms raise for that collective.
    # collectives=("all_gather", "reduce_scatter", "all_to_all"),
    # Transfers progress while the host computes (gloo's do, in its own threads). Nothing acts on it yet (auto's
    # policy and the overlap tier are meant to); say the truth.
    overlap=True,
    # auto without a profile: vanilla for ring hops under this many bytes (None: 64 KiB). Compare ring and
    # vanilla with `commfuse bench --preset tiny` on your hardware before lowering it.
    auto_min_slice_bytes=None,
    # True promises that every call of a signature after its first can be captured in your device's graph API
    # and replayed (torch.cuda.graph / make_graphed_callables / torch.compile(mode="reduce-overhead") on CUDA):
    # post and wait never sync the host (no .item(), no Event.synchronize, no blocking Work.wait), buffers come
    # from the caching allocator, and any side stream you issue from is joined back into the capture (see
    # backends/cuda's CommStream.leave). commfuse.graphs.capture refuses backends without it, and the
    # conformance suite's capture tier runs where it is declared. gloo on CPU has no device graphs: False.
    capturable=False,
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
