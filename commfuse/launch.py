"""Launch a function on N local ranks, each a real process in one gloo group.

The parent process owns the rendezvous ``TCPStore`` on a port the kernel
picks (port 0), so concurrent launches never race for a port; the children
join it as clients. Every child sets ``torch.set_num_threads(threads)``,
initialises the process group, runs ``fn(rank, world_size, *args)`` and sends
back its result or its traceback *before* tearing the group down. The teardown
gets :data:`TEARDOWN_S` seconds; past that, or if a step of it failed, the rank
exits at once with ``os._exit``: a gloo thread stuck in a collective that a
peer abandoned keeps ``destroy_process_group`` (and a group left alive keeps
the interpreter's exit) waiting until the group's own timeout. The parent
waits at most ``timeout`` seconds, then kills every child that is still
running and says which ranks did not finish: a launch never hangs and never leaves processes behind. On
Linux each rank also asks the kernel to kill it when its parent ends (``PR_SET_PDEATHSIG``), so a parent
that is itself killed (SIGTERM, SIGKILL) takes its ranks with it.

Ranks start as fresh interpreters (``spawn``) by default. ``COMMFUSE_LAUNCH_START=forkserver`` forks them
from one server process per launcher that has imported torch and commfuse's layers already (:data:`START_ENV`,
:data:`FORKSERVER_PRELOAD`, and :data:`PRELOAD_ENV` for more): a launch then costs about 0.2 s instead of 2 to
3 s on two cores, which is what a test suite of many launches wants (this project's sets it). Keep ``spawn``
where importing torch initialises a device runtime that a fork would copy (a vendor's package that torch loads
at import).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_module
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from commfuse.errors import CommfuseError, CommfuseValueError, first_line
from commfuse.runtime.env import choice, flag, names


class LaunchError(CommfuseError, RuntimeError):
    """One or more ranks raised, died or did not finish."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


#: Seconds a rank gives its teardown (``destroy_process_group`` and friends) after it has reported. A gloo
#: worker thread stuck in a collective that a peer abandoned keeps destroy waiting until the group's own
#: timeout; past this bound the rank exits without it (its result is already with the parent).
TEARDOWN_S = 5.0


def _report(results, rank: int, ok: bool, value: Any) -> None:
    """Put ``(rank, ok, value)`` on the queue and wait until it is written to the pipe."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(value)  # the queue pickles in its feeder thread, which would drop it silently
    except Exception as e:  # noqa: BLE001 - reported instead of the value
        ok, value = False, f"the result of rank {rank} cannot be sent back ({type(e).__name__}: {e})"
    results.put((rank, ok, value))
    results.close()
    results.join_thread()  # flushed now: nothing later (a hung teardown, os._exit) can lose it


def _teardown() -> bool:
    """Release the backends and destroy the process group within :data:`TEARDOWN_S`; whether all of it worked.

    Each step is tried even when an earlier one failed. When one failed or
    destroy is still waiting, the group may still be alive, and its destructor
    would block the interpreter's exit the same way: the caller exits hard.
    """
    clean = []

    def work() -> None:
        import gc

        import torch.distributed as dist

        ok = True
        try:
            from commfuse.backends import release

            release()  # a backend kept past destroy can abort the process at exit
        except Exception:  # noqa: BLE001
            ok = False
        gc.collect()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a failed rank may leave the group unusable
            ok = False
        clean.append(ok)

    thread = threading.Thread(target=work, name="commfuse-launch-teardown", daemon=True)
    thread.start()
    thread.join(TEARDOWN_S)
    return clean == [True]


#: Set to 1, every launched rank looks like its own host to NCCL (a distinct ``NCCL_HOSTID``, and NCCL's
#: transports that assume one host switched off), so that several NCCL ranks can share one GPU: NCCL
#: otherwise refuses two ranks on one device ("Duplicate GPU detected"). For checking a device path on a
#: one-GPU machine; the ranks then talk over sockets on the loopback. The same trick as a per-rank
#: ``NCCL_HOSTID`` wrapper under torchrun (docs/benchmarks.md).
ONE_GPU_ENV = "COMMFUSE_NCCL_HOST_PER_RANK"


def rank_environment(rank: int) -> dict[str, str]:
    """What a launched rank adds to its environment before it initialises its group (see
    :data:`ONE_GPU_ENV`)."""
    if not flag(ONE_GPU_ENV, False):
        return {}
    return {"NCCL_HOSTID": f"commfuse-rank-{rank}", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}


#: How launched ranks start: ``spawn`` (the default: a fresh interpreter per rank, which imports torch itself)
#: or ``forkserver`` (each rank forked from one server process per launcher that has imported torch already:
#: a launch costs a fork instead of an interpreter and torch's import, about 1.2 s of CPU per rank; for test
#: suites that launch thousands of times, as this project's does). Either way each rank gets the launcher's
#: environment as it is at the launch (plus ``env``), not as it was when the server started.
START_ENV = "COMMFUSE_LAUNCH_START"

#: The values of :data:`START_ENV`.
START_METHODS = ("spawn", "forkserver")

#: What the forkserver imports once, before it forks any rank: torch, and commfuse with the modules a rank's work
#: imports (the layers; the tensor-parallel styles, with DTensor), which each rank would otherwise import itself
#: after the fork (about half a second of CPU a rank on two cores). :data:`PRELOAD_ENV` adds more.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "commfuse", "commfuse.nn",
                      "commfuse.tp")

#: More modules for the forkserver to import before it forks: dotted names separated by commas
#: (``transformers``; the test suite names it where it is installed). Read when a launcher starts its server
#: (its first ``forkserver`` launch); a name that is not a module name, or whose package is not installed,
#: raises :class:`CommfuseValueError` naming the variable and the name.
PRELOAD_ENV = "COMMFUSE_LAUNCH_PRELOAD"


def _preload() -> list[str]:
    """:data:`FORKSERVER_PRELOAD` and what :data:`PRELOAD_ENV` adds."""
    import importlib.util

    extra = names(PRELOAD_ENV)
    for name in extra:
        top = name.partition(".")[0]
        if importlib.util.find_spec(top) is None:
            raise CommfuseValueError(f"{PRELOAD_ENV} names {name!r}, and no package {top!r} is installed: "
                                     "name installed modules, or leave it unset or empty for none")
    return list(dict.fromkeys(FORKSERVER_PRELOAD + extra))


def _context():
    """The multiprocessing context ranks start in (:data:`START_ENV`)."""
    method = choice(START_ENV, "spawn", START_METHODS)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_preload())
    return ctx


def running_ranks() -> set[int]:
    """The ranks this process has launched that are still there, zombies included (Linux and others with
    ``ps``; an empty set without it): its child processes and, where ranks fork from a forkserver
    (:data:`START_ENV`), the server's children; not multiprocessing's resource tracker or the forkserver
    itself, which are started with the first launch and meant to outlive it. The conformance suite's
    robustness tier checks with it that no rank outlives its launch."""
    try:
        text = subprocess.run(["ps", "-e", "-ww", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    except FileNotFoundError:  # pragma: no cover - no ps
        return set()
    me, rows = os.getpid(), []
    for line in text.splitlines():
        pid, ppid, args = (line.strip().split(None, 2) + ["", ""])[:3]
        if pid.isdigit() and ppid.isdigit():
            rows.append((int(pid), int(ppid), args))
    servers = {pid for pid, ppid, args in rows if ppid == me and "multiprocessing.forkserver" in args}
    pids = set()
    for pid, ppid, args in rows:
        if ppid == me and pid not in servers and "resource_tracker" not in args and not args.startswith("ps "):
            pids.add(pid)
        elif ppid in servers:  # a rank forked by this process's forkserver
            pids.add(pid)
    return pids


#: ``prctl`` option (linux/prctl.h): the signal this process gets when the thread that started it ends.
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this rank when the process that launched it ends (Linux; elsewhere nothing).

    The parent's ``finally`` kills its ranks when it returns or raises, but not when it is killed itself
    (SIGTERM, SIGKILL): its ranks would run on, waiting on peers, with nobody to report to.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl (another libc): the parent's own cleanup still applies
        return
    parent = mp.parent_process()
    if parent is None:
        return
    if os.getppid() == parent.pid:  # spawned: the launcher is the parent the signal watches
        return
    if not parent.is_alive():  # the launcher died before prctl took effect
        os._exit(1)
    # Forked by a forkserver, the parent the signal watches is the server, and the server ends only once
    # every process holding its "alive" pipe has: its ranks hold it too, so a killed launcher would leave
    # both waiting on each other. The launcher's end of the pipe it started this rank through closes when it
    # ends, whatever ended it: a thread waits on that and ends the rank.
    threading.Thread(target=_exit_with, args=(parent.sentinel,), name="commfuse-launch-parent", daemon=True).start()


def _exit_with(sentinel) -> None:
    """Exit this process (status 1) once ``sentinel`` (its launcher's pipe end) says the launcher is gone."""
    from multiprocessing.connection import wait

    wait([sentinel])
    os._exit(1)


def _child(fn, rank, world_size, port, args, results, threads, backend, env) -> None:
    _die_with_parent()
    if os.environ != env:  # a forked rank has the environment its server started with: the launcher's now
        os.environ.clear()
    os.environ.update(env)
    os.environ.update(rank_environment(rank))
    initialised = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        from commfuse.runtime.watchdog import watchdog

        # a host held inside a transport past its deadline is ended by the watchdog: its error is the result
        watchdog().on_fatal.append(lambda e: _report(results, rank, False, f"{type(e).__name__}: {e}"))
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        initialised = True
        ok, value = True, fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        ok, value = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    # Report first: tearing down can block on a collective a peer abandoned (gloo waits for its worker threads).
    _report(results, rank, ok, value)
    if initialised and not _teardown():
        # destroy is stuck in (or failed beside) a collective a peer abandoned; the parent already has this
        # rank's result, and a peer waiting on this process's sockets is released only by its exit
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(0)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    allow_failures: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    The processes start as :data:`START_ENV` says (``spawn`` unless set), each with this process's
    environment as it is now, plus ``env``.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises
    :class:`LaunchError` naming every rank that raised, died or timed out,
    unless ``allow_failures``, in which case a failed rank's entry is the
    ``LaunchError``-style message string prefixed with ``"FAILED: "``.
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    results = ctx.Queue()
    environment = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, store.port, args, results, threads, backend,
                                         environment), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
                got[rank] = (ok, value)
            except queue_module.Empty:
                # a rank that died without reporting (SIGKILL, abort) never will
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                if dead:
                    time.sleep(0.2)  # let a just-exited rank's report arrive
                    while True:
                        try:
                            rank, ok, value = results.get_nowait()
                            got[rank] = (ok, value)
                        except queue_module.Empty:
                            break
                    for r in dead:
                        if r not in got:
                            got[r] = (False, f"died with exit code {procs[r].exitcode} without reporting")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
        del store
    failures = {r: v for r, (ok, v) in got.items() if not ok}
    for r in range(world_size):
        if r not in got:
            failures[r] = f"did not finish within {timeout:g} s (killed)"
    if failures and not allow_failures:
        lines = [f"rank {r}: {first_line(msg, None)}" for r, msg in sorted(failures.items())]
        details = "\n\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        raise LaunchError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(lines) + "\n\n" + details,
                          failures)
    return [got[r][1] if got.get(r, (False,))[0] else f"FAILED: {failures[r]}" for r in range(world_size)]
