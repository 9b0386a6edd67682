"""The ``npu`` backend's plugin record and availability check.

torch_npu is never imported where it cannot work: without CANN's libraries
its import fails (and, installed next to torch, it even breaks ``import
torch`` through torch's device-backend autoload). So the check goes in order,
cheapest and safest first, and stops at the first thing missing:

1. is torch_npu importable at all (``importlib.util.find_spec``)?
2. is CANN's ``libhccl.so`` on disk where the loader will look
   (``ASCEND_HOME_PATH``/``ASCEND_TOOLKIT_HOME``, ``LD_LIBRARY_PATH``, the
   default install prefix)?
3. does ``import torch_npu`` succeed?
4. is an NPU visible (``torch.npu.device_count()``), and is the ``hccl``
   backend registered with torch.distributed?

:func:`probe` gathers those facts, :func:`decide` (pure) turns them into a
verdict with the reason and the fix; both are tested here, where step 1 is
the true answer.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from commfuse.plugins import Availability, BackendSpec, hookimpl
from commfuse_npu.capabilities import CAPABILITIES


#: Where CANN installs by default, and the environment variables its set_env.sh exports.
DEFAULT_CANN = "/usr/local/Ascend/ascend-toolkit/latest"
CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_FIX = (
    "install Ascend CANN (the toolkit and kernels packages for your driver) and load its environment: "
    f"source {DEFAULT_CANN.rsplit('/', 1)[0]}/set_env.sh (it sets ASCEND_HOME_PATH and LD_LIBRARY_PATH)"
)


def torch_npu_fix(torch_version: str) -> str:
    base = torch_version.split("+")[0]
    return (
        f"on an Ascend host with CANN installed, pip install torch-npu=={base} (torch-npu releases pair with "
        f"torch releases; yours is torch {torch_version}); never install torch-npu where CANN is missing: it "
        "autoloads with `import torch` and breaks it"
    )


@dataclass(frozen=True)
class Facts:
    torch_version: str
    torch_npu_found: bool  # importlib.util.find_spec("torch_npu") is not None
    libhccl: str | None  # path of CANN's libhccl.so, when found
    searched: tuple[str, ...] = ()  # directories looked in for it
    import_error: str = ""  # why `import torch_npu` failed, when it was tried and did
    device_count: int = 0
    hccl_registered: bool = False
    device_name: str = ""


def find_libhccl(env: Mapping[str, str], exists: Callable[[str], bool] = os.path.isfile) -> tuple[str | None, tuple[str, ...]]:
    """Where CANN's ``libhccl.so`` is, looking where the loader and CANN's set_env.sh would put it.

    Returns ``(path or None, directories searched in order)``.
    """
    dirs: list[str] = []
    for var in CANN_ENV:
        if env.get(var):
            dirs.append(os.path.join(env[var], "lib64"))
    dirs += [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs.append(os.path.join(DEFAULT_CANN, "lib64"))
    seen: list[str] = []
    for d in dirs:
        if d in seen:
            continue
        seen.append(d)
        path = os.path.join(d, "libhccl.so")
        if exists(path):
            return path, tuple(seen)
    return None, tuple(seen)


def probe(env: Mapping[str, str] | None = None) -> Facts:
    """The facts of this process; imports torch_npu only when it is installed and CANN is on disk."""
    import torch

    env = os.environ if env is None else env
    found = importlib.util.find_spec("torch_npu") is not None
    lib, searched = find_libhccl(env)
    facts = Facts(torch.__version__, found, lib, searched)
    if not found or lib is None:
        return facts
    try:
        import torch_npu  # noqa: F401 - registers torch.npu and the hccl backend
    except Exception as e:  # noqa: BLE001 - any failure here is the answer
        return Facts(torch.__version__, True, lib, searched, f"{type(e).__name__}: {e}")
    import torch.distributed as dist

    count = int(torch.npu.device_count())
    name = torch.npu.get_device_name(0) if count else ""
    hccl = dist.is_available() and "hccl" in getattr(dist.Backend, "backend_list", [])
    return Facts(torch.__version__, True, lib, searched, "", count, bool(hccl), name)


def decide(f: Facts) -> Availability:
    """Whether the npu backend can run, from the facts; every 'no' names what is missing and the fix."""
    if not f.torch_npu_found:
        return Availability.no(
            "torch_npu is not importable in this environment (no module named 'torch_npu')", torch_npu_fix(f.torch_version)
        )
    if f.libhccl is None:
        return Availability.no(
            "torch_npu is installed but CANN's libhccl.so is missing (looked in " + ", ".join(f.searched) + ")",
            CANN_FIX,
        )
    if f.import_error:
        return Availability.no(
            f"import torch_npu fails with torch {f.torch_version}: {f.import_error}",
            "install the torch-npu release made for this torch and the CANN version it names; " + CANN_FIX,
        )
    if f.device_count < 1:
        return Availability.no(
            "no NPU is visible (torch.npu.device_count() is 0)",
            "check the Ascend driver with `npu-smi info`, and that ASCEND_RT_VISIBLE_DEVICES does not hide the NPUs",
        )
    if not f.hccl_registered:
        return Availability.no(
            "torch_npu imported but torch.distributed has no 'hccl' backend",
            "reinstall torch-npu for this torch release (it registers HCCL with torch.distributed)",
        )
    return Availability.yes(f"{f.device_count} NPU(s) ({f.device_name}) with HCCL ({f.libhccl})")


def check() -> Availability:
    return decide(probe())


def factory(group=None, device=None):
    from commfuse_npu.backend import NpuBackend

    return NpuBackend(group=group, device=device)


@hookimpl
def commfuse_backends() -> Iterator[BackendSpec]:
    yield BackendSpec(
        name="npu",
        device_types=("npu",),
        capabilities=CAPABILITIES,
        check=check,
        factory=factory,
        description="Ascend NPUs: HCCL through torch_npu; MC2 fused kernels exactly where their constraints hold",
        # Wins over the generic 'accelerator' path (priority -10) for npu tensors.
        priority=10,
        install_hint="pip install -e backends/npu (needs torch-npu and Ascend CANN, not installed by it)",
    )
