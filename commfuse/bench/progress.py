"""A progress bar on stderr without a dependency: one redrawn line on a terminal, a line per 10% elsewhere."""

from __future__ import annotations

import sys
import time


class Progress:
    WIDTH = 30

    def __init__(self, total: int, *, enabled: bool = True, stream=None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()
        self.last_tenth = -1
        self.last_draw = 0.0

    def advance(self, label: str = "", n: int = 1) -> None:
        if not self.enabled:
            return
        self.done = min(self.total, self.done + n)
        frac = self.done / self.total
        elapsed = time.monotonic() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        if self.tty:
            now = time.monotonic()
            if now - self.last_draw < 0.1 and self.done < self.total:
                return
            self.last_draw = now
            filled = int(self.WIDTH * frac)
            bar = "#" * filled + "." * (self.WIDTH - filled)
            line = f"\r[{bar}] {100 * frac:5.1f}% {elapsed:5.0f} s, ~{eta:4.0f} s left  {label}"
            self.stream.write(line[:160].ljust(100))
            if self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()
            return
        tenth = int(10 * frac)
        if tenth > self.last_tenth:
            self.last_tenth = tenth
            self.stream.write(f"commfuse bench: {100 * frac:3.0f}% after {elapsed:.0f} s (~{eta:.0f} s left) {label}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (a workload starting), keeping the bar intact on a terminal."""
        if not self.enabled:
            return
        self.stream.write(("\r" if self.tty else "") + text.ljust(100 if self.tty else 0) + "\n")
        self.stream.flush()
