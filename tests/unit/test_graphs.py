"""Tier (a), no processes: device-graph capture as far as a CPU can take it: the ``capturable`` capability
and who declares it, ``commfuse.graphs.capture``'s refusals and its once-per-signature cache (through a
stand-in for torch.cuda's graph API), and the runtime's capture rules (the host check refused in a capture,
captured calls' buffers kept apart, captured steps kept from a paused-or-not watchdog). What needs a GPU
skips by ``torch.cuda.is_available()``."""

from __future__ import annotations

import importlib
import time
from types import SimpleNamespace

import pytest
import torch

import commfuse as cf
from commfuse import backends
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.graphs import Captured, capture, check_capturable, closure_leaves, signature_key
from commfuse.plugins import Capabilities
from commfuse.runtime.compiled import Plan
from commfuse.runtime.groups import capture_probe
from commfuse.runtime.walks import execute
from commfuse.runtime.programs import BufferPool
from commfuse.runtime.watchdog import Watchdog
from commfuse.schedule import build

CUDA0 = torch.device("cuda", 0)  # a device object needs no GPU


# -- the capability ----------------------------------------------------------------------------------------------


def test_capturable_defaults_to_false_and_must_be_a_bool():
    assert Capabilities().capturable is False
    assert Capabilities(capturable=True).capturable is True
    with pytest.raises(CommfuseTypeError, match="Capabilities.capturable must be a bool, got str 'yes'"):
        Capabilities(capturable="yes")


def test_builtin_backends_do_not_declare_capturable():
    assert backends.spec("gloo").capabilities.capturable is False
    assert backends.spec("accelerator").capabilities.capturable is False


@pytest.mark.parametrize("module, declared", [("commfuse_cuda.plugin", True), ("commfuse_npu.plugin", True),
                                              ("commfuse_xla.plugin", False), ("commfuse_template.plugin", False)])
def test_vendor_backends_declare_capturable_as_documented(module, declared):
    plugin = pytest.importorskip(module, reason=f"{module.split('.')[0]} is installed by ci/test_backends.sh")
    assert plugin.CAPABILITIES.capturable is declared


def test_the_backend_listing_serialises_capturable():
    import dataclasses

    assert dataclasses.asdict(backends.spec("gloo").capabilities)["capturable"] is False


# -- commfuse.graphs.capture's refusals ---------------------------------------------------------------------------


def test_cpu_tensors_are_refused_naming_the_device_and_the_backend():
    f = capture(lambda a, b: a @ b)
    with pytest.raises(CommfuseValueError) as e:
        f(torch.ones(2, 2), torch.ones(2, 2))
    text = str(e.value)
    assert "captures cuda work" in text and "on cpu" in text
    assert "no commfuse backend (torch.distributed is not initialised" in text
    assert f.signatures == 0


def test_a_backend_without_capturable_is_refused_by_name():
    gloo = SimpleNamespace(name="gloo", capabilities=backends.spec("gloo").capabilities)
    with pytest.raises(CommfuseValueError, match=r"backend 'gloo' that commfuse resolves for cuda:0 does not "
                                                 r"declare Capabilities\.capturable"):
        check_capturable(CUDA0, gloo)
    generic = SimpleNamespace(name="accelerator", capabilities=backends.spec("accelerator").capabilities)
    with pytest.raises(CommfuseValueError, match="install commfuse-cuda"):
        check_capturable(CUDA0, generic)
    with pytest.raises(CommfuseValueError, match="no Capabilities record"):
        check_capturable(CUDA0, SimpleNamespace(name="toy", capabilities=None))
    with pytest.raises(CommfuseValueError, match="captures cuda work .* on cpu"):
        check_capturable(torch.device("cpu"), None)
    check_capturable(CUDA0, SimpleNamespace(name="cuda", capabilities=Capabilities(capturable=True)))
    check_capturable(CUDA0, None)  # no process group: plain local compute


def test_bad_options_are_refused():
    with pytest.raises(CommfuseValueError, match="warmup must be an int >= 1, got 0"):
        capture(lambda x: x, warmup=0)
    with pytest.raises(CommfuseValueError, match="warmup must be an int >= 1, got True"):
        capture(lambda x: x, warmup=True)
    with pytest.raises(CommfuseTypeError, match="needs a module or a function"):
        capture(3)
    with pytest.raises(CommfuseTypeError, match="backward must be a bool"):
        capture(lambda x: x, backward="yes")


# -- the signature of a call --------------------------------------------------------------------------------------


def test_signature_key_sees_shapes_dtypes_devices_grad_and_values():
    a = torch.ones(2, 3)
    key = signature_key((a, 4), {"dim": 0})
    assert key == signature_key((torch.zeros(2, 3), 4), {"dim": 0})  # values of tensors do not matter
    for other in [((torch.ones(3, 3), 4), {"dim": 0}), ((a.double(), 4), {"dim": 0}),
                  ((a.clone().requires_grad_(), 4), {"dim": 0}), ((a, 5), {"dim": 0}), ((a, 4), {"dim": 1}),
                  ((a, 4.0), {"dim": 0}), (([a], 4), {"dim": 0})]:
        assert signature_key(*other) != key, other
    nested = signature_key(([a, {"w": a}],), {})
    assert nested == signature_key(([torch.ones(2, 3), {"w": torch.ones(2, 3)}],), {})


def test_signature_key_refuses_unhashable_arguments_by_path():
    with pytest.raises(CommfuseTypeError, match=r"argument args\[1\]\['sizes'\] is an unhashable set"):
        signature_key((torch.ones(1), {"sizes": {1, 2}}), {})
    assert signature_key(([1, 2],), {}) != signature_key(([1, 3],), {})  # lists of values are fine


# -- the once-per-signature cache, through a stand-in for torch.cuda's graph API ----------------------------------


class FakeGraphs:
    """torch.cuda's graph calls as :class:`commfuse.graphs.Captured` uses them, on CPU: a "capture" runs the
    function once and its "replay" runs it again, writing into the outputs the capture returned (the static
    outputs), as a real replay writes into the captured memory."""

    device_type = "cpu"

    def __init__(self):
        self.warmups = self.captures = self.replays = 0
        self.made = []

    def warm_up(self, fn, times, device):
        self.warmups += times
        for _ in range(times):
            fn()

    def capture(self, fn, device, pool):
        self.captures += 1
        outputs = fn()

        def replay():
            self.replays += 1
            with torch.no_grad():
                outputs.copy_(fn())

        return replay, outputs

    def make_graphed(self, fn, sample_args, warmup, pool):
        self.made.append(sample_args)
        if isinstance(fn, torch.nn.Module):
            original = fn.forward
            fn.forward = lambda *args: original(*args) * 1  # as torch does: the module's forward, replaced
            return fn
        return fn


def test_each_signature_is_captured_once_and_replayed_with_the_new_inputs():
    graphs = FakeGraphs()
    seen = []

    def fn(a, b, *, scale):
        seen.append(a.data_ptr())
        return a @ b * scale

    f = Captured(fn, warmup=2, _graphs=graphs)
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    with torch.no_grad():
        y = f(a, b, scale=2.0)
        torch.testing.assert_close(y, a @ b * 2)
        assert (graphs.warmups, graphs.captures, graphs.replays) == (2, 1, 1)
        assert a.data_ptr() not in seen  # warm-up and capture ran on static copies of the inputs
        a2, b2 = torch.randn(4, 3), torch.randn(3, 2)
        y2 = f(a2, b2, scale=2.0)
        assert y2 is y  # the static outputs, overwritten by each replay
        torch.testing.assert_close(y2, a2 @ b2 * 2)
        assert (graphs.warmups, graphs.captures, graphs.replays, f.signatures) == (2, 1, 2, 1)
        f(torch.randn(5, 3), b2, scale=2.0)  # a new shape: a new graph
        f(a2, b2, scale=3.0)  # a new value of a non-tensor argument: a new graph
        assert (graphs.captures, f.signatures) == (3, 3)
    f.reset()
    assert f.signatures == 0


def test_a_forward_only_graph_refuses_inputs_that_want_gradients():
    f = Captured(lambda a: a * 2, _graphs=FakeGraphs())
    a = torch.randn(3, requires_grad=True)
    with pytest.raises(CommfuseValueError, match=r"backward=False.*argument 0 \[3\] require grad.*torch.no_grad"):
        f(a)
    with torch.no_grad():
        torch.testing.assert_close(f(a), a.detach() * 2)
    lin = torch.nn.Linear(3, 3)
    g = Captured(lin, _graphs=FakeGraphs())
    with pytest.raises(CommfuseValueError, match="parameter 'weight'"):
        g(torch.randn(2, 3))


def test_commfuse_check_always_cannot_be_captured(monkeypatch):
    monkeypatch.setenv("COMMFUSE_CHECK", "always")
    f = Captured(lambda a: a * 2, _graphs=FakeGraphs())
    with torch.no_grad(), pytest.raises(CommfuseValueError, match="COMMFUSE_CHECK=always"):
        f(torch.ones(2))


def test_backward_graphs_take_tensors_only_and_refuse_closed_over_weights():
    w = torch.randn(3, 2, requires_grad=True)
    f = Captured(lambda a: a @ w, backward=True, _graphs=FakeGraphs())
    with pytest.raises(CommfuseValueError, match=r"1 tensor\(s\) that require grad but are neither its arguments "
                                                 r"nor a module's parameters \(\[3, 2\] torch.float32\)"):
        f(torch.randn(4, 3, requires_grad=True))
    g = Captured(lambda a, n: a * n, backward=True, _graphs=FakeGraphs())
    with pytest.raises(CommfuseTypeError, match="tensors only, passed positionally; got Tensor, int"):
        g(torch.randn(2, requires_grad=True), 3)


def test_backward_graphs_of_a_module_leave_its_forward_as_it_was():
    graphs = FakeGraphs()
    lin = torch.nn.Linear(3, 2)
    f = Captured(lin, backward=True, _graphs=graphs)
    x = torch.randn(4, 3, requires_grad=True)
    y = f(x)
    assert "forward" not in lin.__dict__  # the class's forward again
    torch.testing.assert_close(y, lin(x))
    assert len(graphs.made) == 1 and graphs.made[0][0] is not x  # make_graphed_callables got static copies
    f(torch.randn(5, 3, requires_grad=True))
    assert f.signatures == 2 and len(graphs.made) == 2 and "forward" not in lin.__dict__


def test_closure_leaves_finds_leaves_outside_the_allowed_ones():
    x, w, frozen = torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True), torch.randn(3, 3)
    out = (x @ w @ frozen).sum()
    assert [t is w for t in closure_leaves([out], [x])] == [True]
    assert closure_leaves([out], [x, w]) == []


# -- the runtime's capture rules ----------------------------------------------------------------------------------


def test_capture_probe_is_none_where_there_is_no_graph_api():
    assert capture_probe(torch.device("cpu")) is None
    assert capture_probe(None) is None
    assert capture_probe(torch.device("meta")) is None
    assert capture_probe(CUDA0) is torch.cuda.is_current_stream_capturing


def test_a_captured_call_keeps_its_buffers_apart_from_eager_calls():
    backend = SimpleNamespace(device=torch.device("cpu"), empty=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    pool = BufferPool(backend)
    assert pool.probe is None
    key = ((4,), torch.float32)
    pool.claim([key])  # as a plan in the planning table claims its shapes: the pool keeps their buffers
    eager = pool.get(key)
    pool.put(eager, key)
    capturing = [True]
    pool.probe = lambda: capturing[0]
    inside = pool.get(key)
    assert inside is not eager  # a captured call never takes an eager call's buffer
    pool.put(inside, key)
    assert pool.free[key] == [eager]  # nor gives one back to them
    capturing[0] = False
    assert pool.get(key) is eager


class _Program:
    def meta(self):
        return []


class _Backend:  # what a Plan reads of a backend (hashable: its group state is keyed by it)
    rank, world_size, device, name = 0, 2, CUDA0, "fake"


def _plan(check: str = "once"):
    schedule = build("all_gather", 2, algorithm="ring")
    backend = _Backend()
    plan = Plan(schedule, backend, label="all_gather_consume", timeout=10.0, check=check)
    plan.probe = lambda: True  # the current stream is capturing
    return plan


def test_a_call_that_must_check_is_refused_inside_a_capture():
    plan = _plan()
    with pytest.raises(CommfuseValueError) as e:
        execute(plan, _Program())
    text = str(e.value)
    assert "rank 0: all_gather_consume" in text and "is being captured in a device graph" in text
    assert "this is the first call of its signature on the group" in text and "Run the call eagerly" in text
    assert not plan.capturing and plan.state.dirty and plan.state.lock.acquire(False)  # left as it was
    plan.state.lock.release()
    with pytest.raises(CommfuseValueError, match="an earlier call on the group failed"):
        execute(plan, _Program())
    with pytest.raises(CommfuseValueError, match="COMMFUSE_CHECK=always"):
        execute(_plan("always"), _Program())


def test_captured_steps_are_not_handed_to_the_watchdog():
    from commfuse.runtime import c10d
    from commfuse.runtime.watchdog import watchdog

    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1

        def is_completed(self):
            return True

    def handle(capturing: bool):
        h = c10d._StreamHandle.__new__(c10d._StreamHandle)
        h.works, h.outputs, h.inflight = [Work()], ["out"], None
        h.backend, h.what = SimpleNamespace(_expired=lambda e: None), "step"
        h.plan = SimpleNamespace(capturing=capturing)  # the executor's plan of the call
        return h

    dog = watchdog()
    with dog.paused():  # nothing polls while this test counts
        before = len(dog.pending)
        assert handle(True).wait(5.0) == ["out"]
        assert len(dog.pending) == before and Work.waited == 1  # the stream still waits; the watchdog is not told
        handle(False).wait(5.0)
        assert len(dog.pending) == before + 1


def test_a_paused_watchdog_queries_nothing_and_moves_deadlines_on():
    class Work:
        asked = 0

        def is_completed(self):
            Work.asked += 1
            return False

    fired = []
    dog = Watchdog(poll_s=3600)  # polled by hand here
    dog.exit = False
    with dog.paused():
        dog.watch([Work()], time.monotonic() + 0.2, lambda cause: "step 0 of the test", fired.append)
        with dog.paused():  # holds nest
            time.sleep(0.3)
        dog.poll()
        assert Work.asked == 0  # held: the poll asked nothing
    dog.poll()  # released: the poll asks again; the 0.3 s held do not count against the step's 0.2 s
    assert Work.asked == 1 and fired == [] and len(dog.pending) == 1
    time.sleep(0.25)
    dog.poll()
    assert len(fired) == 1 and "step 0 of the test" in str(fired[0])


def test_commfuse_exposes_graphs_lazily():
    assert cf.graphs is importlib.import_module("commfuse.graphs")
    assert "graphs" in cf.__all__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this project's CI)")
def test_a_local_call_is_captured_and_replayed_on_a_gpu():
    # No process group: commfuse's ops are the local matmul, and capture is torch's own.
    f = capture(lambda a, b: cf.all_gather_matmul(a, b), warmup=2)
    with torch.no_grad():
        for seed in range(3):
            g = torch.Generator(device="cuda").manual_seed(seed)
            a = torch.randn(8, 16, device="cuda", generator=g)
            b = torch.randn(16, 4, device="cuda", generator=g)
            torch.testing.assert_close(f(a, b), a @ b)
    assert f.signatures == 1
