"""The PASS/FAIL lines of the device check scripts (``recorder_device.py``, ``ring_attention_device.py``): one
line per check with its figures, a summary, and the exit status (1 where a check failed on this rank). Imported
from the scripts' own folder, which Python puts first on the path when it runs one of them."""

from __future__ import annotations


class Checks:
    """One rank's checks: :meth:`report` prints each, :meth:`summary` the verdict and returns the exit status."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failed = rank, []

    def report(self, name: str, ok: bool | None, text: str) -> None:
        """``ok`` None: informational, never failed."""
        verdict = "INFO" if ok is None else ("PASS" if ok else "FAIL")
        print(f"[rank {self.rank}] {verdict} {name}: {text}", flush=True)
        if ok is False:
            self.failed.append(name)

    def summary(self) -> int:
        failed = self.failed
        print(f"[rank {self.rank}] SUMMARY: {'FAIL ' + ', '.join(failed) if failed else 'all passed'}", flush=True)
        return 1 if failed else 0
