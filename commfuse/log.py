"""commfuse's log lines, for users: what ``auto`` took and why, where a style falls back to DTensor.

The library logs on the ``commfuse`` logger and, by default, leaves handlers
to the application. ``COMMFUSE_LOG=info`` (or ``debug``), read at ``import
commfuse`` (by ``commfuse.runtime.env``, which refuses a word not in
:data:`WORDS` by name), turns on short lines on stderr without editing code,
each with the rank in front (``[commfuse rank 1] ...``): at ``info`` one line
per new decision (once per call signature, or once per fused site), at
``debug`` what each decision was made on as well. ``warning``, ``error``,
``off`` (or ``0``, ``false``, ``no``) and unset add no handler.
"""

from __future__ import annotations

import logging
import sys
import threading

__all__ = ["LEVELS", "WORDS", "configure", "once"]

#: ``COMMFUSE_LOG`` values that add a handler, and the level each lets through.
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO}
#: Every word ``COMMFUSE_LOG`` takes: :data:`LEVELS`, and those that add no handler.
WORDS = (*LEVELS, "warning", "error", "off", "0", "false", "no")

log = logging.getLogger("commfuse")
_said: set = set()
_lock = threading.Lock()


class _Rank(logging.Filter):
    """Puts ``rank`` on every record: this process's rank in torch.distributed's default group, or "-"."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = "-"
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                rank = str(dist.get_rank())
        except Exception:  # noqa: BLE001 - a log line never fails
            pass
        record.rank = rank
        return True


def configure(value: str | None = None) -> bool:
    """Set up the ``commfuse`` logger for ``value``, a word of :data:`LEVELS` (others, and None, add no
    handler); whether a handler was added. ``import commfuse`` calls it with ``COMMFUSE_LOG``; idempotent."""
    level = LEVELS.get((value or "").strip().lower())
    if level is None:
        return False
    with _lock:
        if not any(getattr(h, "_commfuse", False) for h in log.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[commfuse rank %(rank)s] %(message)s"))
            handler.addFilter(_Rank())
            handler._commfuse = True
            log.addHandler(handler)
        log.setLevel(level)
    return True


def once(key, message: str, *args, level: int = logging.INFO) -> None:
    """``message`` on the ``commfuse`` logger the first time ``key`` is seen in this process."""
    if not log.isEnabledFor(level):
        return
    with _lock:
        if key in _said:
            return
        if len(_said) > 65536:
            _said.clear()
        _said.add(key)
    log.log(level, message, *args)
