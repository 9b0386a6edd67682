"""Rank-side bodies of the gathers commfuse makes on a user's group outside its ops: ``nn``'s gather of a
parameter's shards back into the whole (``gather_dim``, under ``to_linear``, ``gather_experts`` and the
attention's ``to_linears``) and ``commfuse.graphs``' agreement that every rank captured a signature (through a
CPU stand-in for torch.cuda's graph API). Each body reports what this rank raised, how long it took, and
whether a plain commfuse call on the group works afterwards."""

from __future__ import annotations

import os
import time

import torch

import commfuse as cf
from commfuse.schedule import split_sizes

#: the error every refusal below raises on its rank (the peers are told its words)
REFUSAL = "capture failed on purpose"


def _outcome(run) -> tuple[str, str, object, float]:
    start = time.perf_counter()
    value = None
    try:
        value = run()
        kind, message = "ok", ""
    except Exception as e:  # noqa: BLE001 - handed to the test
        kind, message = type(e).__name__, str(e) + "".join("\n" + note for note in getattr(e, "__notes__", ()))
    return kind, message, value, time.perf_counter() - start


def _usable(rank: int, n: int) -> str | None:
    """A later plain commfuse call on the group, against the unsharded product: None, or what went wrong."""
    g = torch.Generator().manual_seed(5)
    whole, w = torch.randn(4 * n, 8, generator=g), torch.randn(8, 6, generator=g)
    try:
        got = cf.all_gather_matmul(whole.tensor_split(n)[rank], w, algorithm="ring")
    except Exception as e:  # noqa: BLE001 - reported
        return f"the call after it raised {type(e).__name__}: {e}"
    if not torch.allclose(got, whole @ w, rtol=1e-5, atol=1e-6):
        return "the call after it computed a wrong product"
    return None


def _whole(shape, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def gather_case(rank: int, n: int, name: str) -> dict:
    """``gather_dim`` (``commfuse.nn._common``) in case ``name``:

    - ``exact``: float32, bfloat16 and int64 tensors split unevenly along dim 0 and dim 1, gathered under
      ``no_grad``, each compared bit for bit with the whole;
    - ``wrong size``: the last rank's piece is one row short of its ``tensor_split`` share;
    - ``other dtype``: the last rank's piece is float64 where its peers' are float32;
    - ``skips``: the last rank does not gather (it returns early and stays alive past the timeout).
    """
    torch.set_num_threads(1)
    from commfuse.nn._common import gather_dim

    if name == "exact":
        wrong = []
        with torch.no_grad():
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                for dim, shape in ((0, (7, 5)), (1, (3, 2 * n + 1))):
                    whole = _whole(shape, dtype)
                    piece = whole.tensor_split(n, dim=dim)[rank].clone()
                    got = gather_dim(piece, dim, shape[dim], None)
                    if got.dtype != dtype or got.shape != whole.shape or not torch.equal(got, whole):
                        wrong.append(f"{dtype} dim {dim}: got {got.dtype} {list(got.shape)}")
        return {"kind": "ok", "message": "; ".join(wrong), "seconds": 0.0, "after": _usable(rank, n)}
    last = rank == n - 1
    whole = _whole((3 * n + 1, 4), torch.float32)
    piece = whole.tensor_split(n)[rank].clone()
    if name == "wrong size" and last:
        piece = piece[:-1]
    if name == "other dtype" and last:
        piece = piece.double()
    if name == "skips" and last:
        time.sleep(float(os.environ["COMMFUSE_TIMEOUT_S"]) * 2)
        return {"kind": "skipped", "message": "", "seconds": 0.0, "after": None}
    kind, message, got, seconds = _outcome(lambda: gather_dim(piece, 0, whole.shape[0], None, what="'proj.weight'"))
    out = {"kind": kind, "message": message, "seconds": seconds, "sizes": split_sizes(whole.shape[0], n)}
    out["after"] = None if name == "skips" else _usable(rank, n)
    return out


class _FakeGraphs:
    """torch.cuda's graph calls as ``commfuse.graphs.Captured`` uses them, on CPU (as in tests/unit/
    test_graphs.py): a "capture" runs the function once, a "replay" again into the captured outputs. On
    ``fail`` the capture raises."""

    device_type = "cpu"

    def __init__(self, fail: bool):
        self.fail, self.replays = fail, 0

    def warm_up(self, fn, times, device):
        for _ in range(times):
            fn()

    def capture(self, fn, device, pool):
        outputs = fn()
        if self.fail:
            raise RuntimeError(REFUSAL)

        def replay():
            self.replays += 1
            outputs.copy_(fn())

        return replay, outputs


def graphs_case(rank: int, n: int, name: str) -> dict:
    """``commfuse.graphs``' agreement in case ``name``:

    - ``capture fails``: ``Captured`` of an all-gather matmul (warm-up, capture, replay through the CPU
      stand-in, gloo's missing ``capturable`` waved through) whose capture raises on the last rank only;
    - ``not ok``: ``failed_ranks`` with the last rank saying it failed: every rank's list;
    - ``skips``: ``failed_ranks`` that the last rank never calls (it stays alive past the timeout).
    """
    torch.set_num_threads(1)
    import commfuse.graphs as graphs

    last = rank == n - 1
    if name == "capture fails":
        graphs.check_capturable = lambda *args, **kwargs: None  # gloo declares no capturable: a stand-in here
        stand_in = _FakeGraphs(fail=last)
        g = torch.Generator().manual_seed(7)
        whole, w = torch.randn(2 * n, 8, generator=g), torch.randn(8, 4, generator=g)
        f = graphs.Captured(lambda a: cf.all_gather_matmul(a, w, algorithm="ring"), warmup=1, _graphs=stand_in)
        with torch.no_grad():
            kind, message, _, seconds = _outcome(lambda: f(whole.tensor_split(n)[rank].clone()))
        return {"kind": kind, "message": message, "seconds": seconds, "replays": stand_in.replays,
                "after": _usable(rank, n)}
    if name == "skips" and last:
        time.sleep(float(os.environ["COMMFUSE_TIMEOUT_S"]) * 2)
        return {"kind": "skipped", "message": "", "seconds": 0.0, "after": None}
    ok = not (name == "not ok" and last)
    kind, message, failed, seconds = _outcome(lambda: graphs.failed_ranks(ok, torch.device("cpu")))
    return {"kind": kind, "message": message, "seconds": seconds, "failed": failed,
            "after": None if name == "skips" else _usable(rank, n)}
