"""CUDA graphs: capture commfuse calls and replay them without the host, and a helper for the common case.

A *planned* commfuse call, any call of a signature after its first, does no
host sync, waits by ordering streams only, and takes its buffers from the
caching allocator, on a backend that declares ``Capabilities.capturable``
(``commfuse-cuda``; ``commfuse-npu`` through ``torch.npu.NPUGraph``, unverified
without Ascend hardware). Such a call can be captured in three ways:

* by the user's own ``torch.cuda.graph``: warm up, capture, copy new inputs
  into the captured (static) inputs, ``graph.replay()`` (torch.cuda.graph
  docs, "Whole-network capture");
* by ``torch.cuda.make_graphed_callables``, which warms up, captures the
  forward and the backward of a module or function, and returns a drop-in
  replacement for training (torch docs, "Partial-network capture");
* by ``torch.compile(mode="reduce-overhead")``: the ops are
  ``torch.ops.commfuse.*`` custom ops with fake kernels, and inductor's
  CUDA-graph trees capture the compiled region, commfuse's calls included.

:func:`capture` does the first (and, with ``backward=True``, the second) once
per input signature and replays on every later call.

What every way needs:

* **Warm up first.** The first call of a signature plans it and checks on the
  host, across the ranks, that every rank calls the same op (the fingerprint
  check). A capture cannot hold a host check: commfuse refuses such a call
  with a ``CommfuseValueError`` naming the op and why. Run each signature
  eagerly at least once before capturing it (``warmup`` here does that;
  make_graphed_callables and torch.compile's warm-up runs do too), also the
  signatures the backward calls.
* **``COMMFUSE_CHECK=always`` cannot be captured**: it checks every call on the
  host. The default (once per signature) and ``0`` can.
* **All ranks capture and replay together**, in the same order: a replay runs
  the captured transfers, and a rank that does not replay leaves its peers'
  transfers waiting. A graph also replays exactly the transfers it captured:
  an algorithm, a shape or a group change needs a new capture (:func:`capture`
  makes one per signature).
* **Nothing outside the graph bounds a replay.** commfuse's watchdog does not
  watch captured steps (it cannot see replays); the process group's own
  timeout (NCCL's watchdog) still does. While a capture is underway the
  watchdog queries nothing: :func:`capture` holds it; around your own
  capture, hold :func:`paused_watchdog` too, or capture with
  ``capture_error_mode="thread_local"`` (what inductor's CUDA-graph trees
  do), so that its thread's queries of earlier steps cannot invalidate the
  capture.
* **Keep commfuse's backends and the group alive while a graph may replay**
  (the graph refers to the backend's events and the group's communicators):
  do not call ``commfuse.backends.release()`` or destroy the group in
  between. Replay graphs that captured calls on one group one at a time, on
  one stream.

Unverified here: this project's CI has no GPU, so nothing in this module has
been replayed on a device by the tests; the conformance suite's capture tier
(``commfuse conformance --tier capture``) runs it where a backend declares
``capturable``. On CPU every path up to the device is tested.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.runtime.groups import register_format

__all__ = ["Captured", "agree_captured", "capture", "check_capturable", "closure_leaves", "failed_ranks",
           "paused_watchdog", "signature_key"]

#: The device type :func:`capture` captures on (torch.cuda's graph API).
DEVICE_TYPE = "cuda"


def paused_watchdog():
    """A context manager holding commfuse's watchdog (no device queries from its thread) for its duration:
    hold it around your own ``torch.cuda.graph`` or ``make_graphed_callables`` capture of commfuse calls
    (:func:`capture` does). See ``commfuse.runtime.watchdog.Watchdog.paused``."""
    from commfuse.runtime.watchdog import watchdog

    return watchdog().paused()


# -- the signature of a call --------------------------------------------------------------------------------------


def signature_key(args: Sequence, kwargs: dict) -> tuple:
    """What one captured graph is good for: per tensor (in tuples, lists and dicts, nested) its shape, dtype,
    device and ``requires_grad``; every other argument by type and value (it is baked into the capture), so it
    must be hashable. Calls with equal keys replay one graph."""
    return (_describe(tuple(args), "args"), _describe(dict(kwargs), "kwargs"))


def _describe(value, where: str):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(v, f"{where}[{i}]") for i, v in enumerate(value)))
    if isinstance(value, dict):
        return ("dict", tuple((k, _describe(v, f"{where}[{k!r}]")) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        raise CommfuseTypeError(
            f"commfuse.graphs.capture: argument {where} is an unhashable {type(value).__name__} ({value!r:.80}); "
            "arguments other than tensors (and tuples, lists and dicts of them) are baked into the graph and "
            "must be hashable, so that calls with equal values can share it; or pass it as a tensor"
        ) from None
    return ("value", type(value), value)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (tuples, lists and dicts, nested), in :func:`signature_key`'s order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _with_tensors(value, fresh: list[torch.Tensor]):
    """``value`` with its tensors replaced, in order, by those popped from the front of ``fresh``."""
    if isinstance(value, torch.Tensor):
        return fresh.pop(0)
    if isinstance(value, (tuple, list)):
        return type(value)(_with_tensors(v, fresh) for v in value)
    if isinstance(value, dict):
        return {k: _with_tensors(v, fresh) for k, v in value.items()}
    return value


# -- what may be captured ---------------------------------------------------------------------------------------


def _device_of(tensors: list[torch.Tensor], device_type: str) -> torch.device:
    """The one device of the tensor arguments, which must be of ``device_type``."""
    if not tensors:
        raise CommfuseValueError(
            f"commfuse.graphs.capture: the call has no tensor arguments, so there is nothing to feed a graph and "
            f"no {device_type} device to capture on; pass the inputs as tensors on a {device_type} device"
        )
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise CommfuseValueError(
            f"commfuse.graphs.capture: the tensor arguments are on several devices ({', '.join(devices)}); a graph "
            f"captures the work of one {device_type} device: put every input on it"
        )
    return tensors[0].device


def _backend_words(backend, group, device) -> str:
    """Which commfuse backend serves ``device`` here and whether it declares ``capturable``, in words, for a
    refusal (never raises)."""
    try:
        from commfuse import backends

        be = backends.resolve(backend, group, device)
    except Exception as e:  # noqa: BLE001 - a message, not a decision
        return f"no commfuse backend ({type(e).__name__}: {e})"
    if be is None:
        return "no commfuse backend (torch.distributed is not initialised: commfuse calls run as one process)"
    declared = getattr(getattr(be, "capabilities", None), "capturable", False)
    return (f"commfuse's backend {getattr(be, 'name', type(be).__name__)!r}, which "
            + ("declares" if declared else "does not declare") + " Capabilities.capturable")


def check_capturable(device: torch.device, be, *, device_type: str = DEVICE_TYPE) -> None:
    """Refuse, naming the device, the backend and why, to capture commfuse calls on ``device`` with the backend
    object ``be`` (what ``commfuse.backends.resolve`` gives; None: no process group, a single process, whose
    calls are plain local compute and always capturable)."""
    if device.type != device_type:
        raise CommfuseValueError(
            f"commfuse.graphs.capture captures {device_type} work (torch.{device_type}'s graph API), but the "
            f"tensor arguments are on {device}"
        )
    if be is None:
        return
    name = getattr(be, "name", type(be).__name__)
    caps = getattr(be, "capabilities", None)
    if caps is None or not getattr(caps, "capturable", False):
        hint = ""
        if name == "accelerator":
            hint = ("; for CUDA devices install commfuse-cuda (pip install commfuse-cuda, or pip install -e "
                    "backends/cuda from a checkout), which declares it")
        raise CommfuseValueError(
            f"commfuse.graphs.capture: the backend {name!r} that commfuse resolves for {device} does not declare "
            f"Capabilities.capturable"
            + (" (it has no Capabilities record)" if caps is None else "")
            + ": its calls may sync the host, or issue from a stream a capture cannot join, so they cannot be "
            f"captured in a device graph{hint}"
        )


# -- the helper ---------------------------------------------------------------------------------------------------


class _CudaGraphs:
    """The device side of :class:`Captured`: torch.cuda's streams and graphs (replaced in the CPU tests)."""

    device_type = DEVICE_TYPE

    def warm_up(self, fn: Callable[[], object], times: int, device: torch.device) -> None:
        """``fn()`` ``times`` times on a side stream (torch.cuda.graph docs: warm up on a side stream, so that
        lazy initialisation stays out of the capture and of the default stream's pool)."""
        cuda = torch.cuda
        side = cuda.Stream(device=device)
        side.wait_stream(cuda.current_stream(device))
        with cuda.stream(side):
            for _ in range(times):
                fn()
        cuda.current_stream(device).wait_stream(side)

    def capture(self, fn: Callable[[], object], device: torch.device, pool) -> tuple[Callable[[], None], object]:
        """Capture ``fn()``; return the graph's replay and ``fn``'s outputs (the static outputs). The capture
        mode is "thread_local", as inductor's CUDA-graph trees capture: other threads (c10d's and commfuse's
        watchdogs) may query events recorded before the capture."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = fn()
        return graph.replay, outputs

    def make_graphed(self, fn, sample_args: tuple, warmup: int, pool):
        return torch.cuda.make_graphed_callables(fn, sample_args, num_warmup_iters=warmup, pool=pool)


#: One capture at a time in the process (torch.cuda.graph docs: only one capture may be underway at a time).
_CAPTURE_LOCK = threading.Lock()


class _Entry:
    """One signature's graph: its static inputs (tensors, in :func:`signature_key`'s order), its replay and
    its outputs; with ``graphed`` (backward=True) make_graphed_callables' callable instead."""

    __slots__ = ("graphed", "outputs", "replay", "static")

    def __init__(self, static, replay=None, outputs=None, graphed=None) -> None:
        self.static, self.replay, self.outputs, self.graphed = static, replay, outputs, graphed

    def __call__(self, args: tuple, kwargs: dict):
        if self.graphed is not None:  # make_graphed_callables copies into its static inputs itself
            return self.graphed(*args)
        with torch.no_grad():  # a static input may be a leaf that requires grad (captured under no_grad)
            for static, new in zip(self.static, _tensors((args, kwargs))):
                if static is not new:
                    static.copy_(new)
        self.replay()
        return self.outputs


class Captured:
    """A callable that captures ``fn`` once per input signature and replays the graph on every later call.

    Returned by :func:`capture`; ``signatures`` counts the graphs captured so far, ``reset()`` drops them.
    """

    def __init__(self, fn: Callable, *, warmup: int = 3, backward: bool = False, pool=None, group=None,
                 backend=None, _graphs=None) -> None:
        if not callable(fn):
            raise CommfuseTypeError(f"commfuse.graphs.capture needs a module or a function, got "
                                    f"{type(fn).__name__} {fn!r:.80}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise CommfuseValueError(
                f"commfuse.graphs.capture: warmup must be an int >= 1, got {warmup!r}: the first call of a "
                "signature plans it and checks on the host that the ranks agree, which cannot be captured"
            )
        if not isinstance(backward, bool):
            raise CommfuseTypeError(f"commfuse.graphs.capture: backward must be a bool, got {backward!r}")
        self.fn, self.warmup, self.backward, self.pool = fn, warmup, backward, pool
        self.group, self.backend = group, backend
        self._graphs = _graphs if _graphs is not None else _CudaGraphs()
        self._entries: dict[tuple, _Entry] = {}

    @property
    def signatures(self) -> int:
        return len(self._entries)

    def reset(self) -> None:
        """Drop every captured graph (the next call of each signature warms up and captures again)."""
        self._entries.clear()

    def __call__(self, *args, **kwargs):
        key = signature_key(args, kwargs)
        if not self.backward:
            key = (key, torch.is_grad_enabled())
        entry = self._entries.get(key)
        if entry is None:
            with _CAPTURE_LOCK:
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = self._capture(args, kwargs)
        return entry(args, kwargs)

    def _capture(self, args: tuple, kwargs: dict) -> _Entry:
        from commfuse import backends
        from commfuse.runtime.groups import check_mode

        graphs = self._graphs
        tensors = _tensors((args, kwargs))
        device_type = graphs.device_type
        if tensors and any(t.device.type != device_type for t in tensors):
            bad = next(t.device for t in tensors if t.device.type != device_type)
            raise CommfuseValueError(
                f"commfuse.graphs.capture captures {device_type} work (torch.{device_type}'s graph API), but a "
                f"tensor argument is on {bad} (served here by {_backend_words(self.backend, self.group, bad)}); "
                f"move the inputs (and the module) to a {device_type} device"
            )
        device = _device_of(tensors, device_type)
        if not self.backward and torch.is_grad_enabled():
            wanting = [f"argument {i} {list(t.shape)}" for i, t in enumerate(tensors) if t.requires_grad]
            if isinstance(self.fn, torch.nn.Module):
                wanting += [f"parameter {n!r}" for n, p in self.fn.named_parameters() if p.requires_grad][:3]
            if wanting:
                raise CommfuseValueError(
                    "commfuse.graphs.capture(backward=False) captures a forward-only graph, whose outputs carry no "
                    f"gradient, but gradients are enabled and {', '.join(wanting[:4])} require grad: they would "
                    "silently get none. Call it under torch.no_grad() (or torch.inference_mode()) for inference, "
                    "or pass backward=True to capture the backward too"
                )
        be = backends.resolve(self.backend, self.group, device)
        check_capturable(device, be, device_type=device_type)
        if check_mode(None) == "always":
            raise CommfuseValueError(
                "commfuse.graphs.capture: COMMFUSE_CHECK=always makes every commfuse call check on the host that "
                "the ranks agree, which a capture cannot do; unset it (the default checks each signature once, "
                "during the warm-up) or set it to 0"
            )
        # static inputs: copies of this call's tensors, which later calls are copied into
        static = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        s_args, s_kwargs = _with_tensors((args, kwargs), list(static))
        try:
            entry, error = (self._graphed if self.backward else self._forward_only)(s_args, s_kwargs, static,
                                                                                     device), None
        except Exception as e:  # noqa: BLE001 - every rank must hear of any failure before any rank replays
            entry, error = None, e
        # A replay runs the captured transfers: a rank whose capture failed would leave its peers' replays
        # waiting on the device. So the ranks agree first, and none replays unless all captured.
        agree_captured(error, device, getattr(be, "group", None) if be is not None else self.group)
        return entry

    def _forward_only(self, s_args: tuple, s_kwargs: dict, static: list[torch.Tensor], device) -> _Entry:
        fn, graphs = self.fn, self._graphs
        with torch.no_grad():  # a forward-only graph: its outputs carry no gradient
            # warm-up with the watchdog on: a peer that never comes is still a named timeout here
            graphs.warm_up(lambda: fn(*s_args, **s_kwargs), self.warmup, device)
            with paused_watchdog():
                replay, outputs = graphs.capture(lambda: fn(*s_args, **s_kwargs), device, self.pool)
        return _Entry(static, replay, outputs)

    def _graphed(self, s_args: tuple, s_kwargs: dict, static: list[torch.Tensor], device) -> _Entry:
        """backward=True: torch.cuda.make_graphed_callables on this signature (forward and backward graphs)."""
        fn = self.fn
        if s_kwargs or len(static) != len(s_args) or not all(isinstance(a, torch.Tensor) for a in s_args):
            raise CommfuseTypeError(
                "commfuse.graphs.capture(backward=True) goes through torch.cuda.make_graphed_callables, which takes "
                "tensors only, passed positionally; got "
                + ", ".join(f"{type(a).__name__}" for a in s_args)
                + (f" and keyword arguments {sorted(s_kwargs)}" if s_kwargs else "")
                + ": bind the other arguments in the function (functools.partial) or the module"
            )
        module = fn if isinstance(fn, torch.nn.Module) else None
        allowed = list(s_args) + (list(module.parameters()) if module is not None else [])
        # A first forward and backward, eagerly and with the watchdog on: they plan the signatures of the
        # forward's and the backward's commfuse calls and check that the ranks agree. And tensors the function
        # reaches that want a gradient but are not among what make_graphed_callables differentiates (the
        # arguments, a module's parameters) would silently get none from the graphed backward: refused.
        with torch.enable_grad():
            outputs = [o for o in _tensors(fn(*s_args)) if o.requires_grad]
            foreign = closure_leaves(outputs, allowed)
            if foreign:
                shapes = ", ".join(f"{list(t.shape)} {t.dtype}" for t in foreign[:4])
                raise CommfuseValueError(
                    f"commfuse.graphs.capture(backward=True): the function uses {len(foreign)} tensor(s) that "
                    f"require grad but are neither its arguments nor a module's parameters ({shapes}); "
                    "make_graphed_callables would give them no gradient. Pass them as arguments, or wrap the "
                    "function in an nn.Module that holds them as parameters"
                )
            wanted = [t for t in allowed if t.requires_grad]
            if outputs and wanted:
                torch.autograd.grad(outputs, wanted, [torch.ones_like(o) for o in outputs], allow_unused=True)
            del outputs
        saved = module.__dict__.get("forward") if module is not None else None
        with paused_watchdog():
            graphed = self._graphs.make_graphed(fn, tuple(s_args), self.warmup, self.pool)
        if module is not None:
            # make_graphed_callables replaced the module's forward with this signature's graphed one (torch docs:
            # it returns the module with its forward graphed); keep that function here and give the module its
            # own forward back, so that other signatures capture from the original and eager calls stay eager.
            graphed = module.forward
            if saved is None:
                del module.forward
            else:
                module.forward = saved
        return _Entry(static, graphed=graphed)


def failed_ranks(ok: bool, device: torch.device, group=None) -> list[int]:
    """Every rank of ``group`` (None: the default group) says whether it succeeded (``ok``); the ranks (in the
    group) that did not, the same list on every rank. One exchange through commfuse's agreement
    (``commfuse.planning.agreement.share``: numbered like every commfuse call on the group and bounded by
    commfuse's timeout, on ``device``'s backend); without an initialised torch.distributed, ``[]`` or ``[0]``:
    this process alone."""
    import torch.distributed as dist

    from commfuse.planning.agreement import share

    if not (dist.is_available() and dist.is_initialized()):
        return [] if ok else [0]
    said = share(dist.group.WORLD if group is None else group, "commfuse.graphs.failed_ranks", lambda: bool(ok), label="graphs.failed_ranks",
                 device=device)
    return [r for r, flag in enumerate(said) if flag is not True]


def agree_captured(error: BaseException | None, device: torch.device, group=None) -> None:
    """The ranks of ``group`` (None: the default group) agree that each captured a signature (``error`` None)
    before any replays it: one exchange through commfuse's agreement (numbered, bounded by commfuse's timeout,
    on ``device``'s backend). A rank whose capture failed raises its ``error`` (a note says its peers were
    told); every other rank raises :class:`~commfuse.errors.PeerFailedError` naming each rank that failed and
    its error's class and first line, and replays nothing. Without an initialised torch.distributed,
    ``error`` is raised as it is."""
    import torch.distributed as dist

    from commfuse.planning.agreement import share

    def captured() -> bool:
        if error is not None:
            raise error
        return True

    if not (dist.is_available() and dist.is_initialized()):
        captured()
        return
    share(dist.group.WORLD if group is None else group, "commfuse.graphs.capture of a signature", captured, label="graphs.capture", device=device,
          so="no rank replays it (a rank that captured it does not replay it, so that no rank waits for "
             "transfers its peers never run)")


def closure_leaves(outputs: Sequence[torch.Tensor], allowed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors that want a gradient (the variables of the ``AccumulateGrad`` nodes) reached from
    ``outputs``' autograd graphs that are not in ``allowed`` (by identity)."""
    known = {id(t) for t in allowed}
    seen: set = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    found: list[torch.Tensor] = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) not in known:
            found.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def capture(module_or_fn: Callable, *, warmup: int = 3, backward: bool = False, pool=None, group=None,
            backend=None) -> Captured:
    """``module_or_fn`` as a callable that captures it in a CUDA graph once per input signature and replays it.

    Per signature (the shapes, dtypes, devices and ``requires_grad`` of the
    tensor arguments, and the values of the others: :func:`signature_key`),
    the first call checks that the tensors are on one CUDA device and that
    the commfuse backend that serves it (``commfuse.backends.resolve(backend,
    group, device)``) declares ``Capabilities.capturable``, refusing with a
    ``CommfuseValueError`` that names the device, the backend and why; then
    copies the tensors into static inputs, runs ``warmup`` eager calls on a
    side stream (the first plans the commfuse calls and checks the ranks
    agree), captures one call with ``torch.cuda.graph`` and replays it. Later
    calls copy their tensors into the static inputs and replay.

    ``backward=False``: a forward-only graph, captured under ``torch.no_grad()``;
    the outputs are the graph's static outputs, overwritten by the next
    replay of the signature (clone what you keep) and carrying no gradient.
    ``backward=True``: ``torch.cuda.make_graphed_callables`` captures the
    forward and the backward (its warm-up runs ``warmup`` forward+backward
    passes); the arguments must be tensors, passed positionally, and only
    they and a module's parameters get gradients: a function that reaches
    other tensors wanting a gradient is refused, by name. ``pool`` is passed
    to the capture (``torch.cuda.graph_pool_handle()`` to share memory
    between graphs replayed in capture order; default: one pool per graph).

    Every rank must call the returned callable with the same signatures in
    the same order (see the module). After capturing, the ranks agree that
    every one of them captured (:func:`agree_captured`, one exchange through
    commfuse's agreement per signature, numbered and bounded by commfuse's
    timeout): if one failed, none replays; it raises its own error and every
    other rank a ``PeerFailedError`` naming it and what it raised. Refuses
    ``COMMFUSE_CHECK=always``.
    """
    return Captured(module_or_fn, warmup=warmup, backward=backward, pool=pool, group=group, backend=backend)


register_format("graphs.capture", lambda v: "commfuse.graphs' agreement of the ranks that each captured a signature")
register_format("graphs.failed_ranks", lambda v: "commfuse.graphs.failed_ranks' exchange of the ranks' verdicts")
