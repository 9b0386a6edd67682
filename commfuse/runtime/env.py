"""What commfuse reads from the environment: the one module that reads a ``COMMFUSE_*`` variable, with one
grammar for each kind of value, each refusing by name (the variable, the value and what it takes) a value it
does not take.

- :func:`flag`: a switch. Unset or empty: the default; ``1``, ``true``, ``yes``, ``on``: on; ``0``,
  ``false``, ``no``, ``off``: off (stripped, in any case); anything else is refused.
- :func:`choice`: one of a variable's words (``COMMFUSE_CHECK``, ``COMMFUSE_LOG``, ``COMMFUSE_LAUNCH_START``).
- :func:`number`: a number in a range (``COMMFUSE_TIMEOUT_S``, ``COMMFUSE_GRACE_S``, ``COMMFUSE_RECORDER``...).
- :func:`size`: a number of bytes, with a binary unit or without (``COMMFUSE_PLAN_BYTES``).
- :func:`text`: a path or a name, taken as it is but stripped (``COMMFUSE_TRACE_DIR``, ``COMMFUSE_PROFILE``).
- :func:`names`: dotted names, separated by commas (``COMMFUSE_LAUNCH_PRELOAD``).

Unset and empty mean the same, the default, except where a reader says what an empty value means
(``COMMFUSE_PROFILE``). It imports nothing but :mod:`commfuse.errors`, so ``import commfuse`` reads
``COMMFUSE_LOG`` through it without importing torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from commfuse.errors import CommfuseValueError

__all__ = ["FALSE_WORDS", "TRUE_WORDS", "choice", "flag", "names", "number", "size", "text"]

#: The words :func:`flag` reads as on and as off (after stripping and lower-casing).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_FLAG = {**dict.fromkeys(TRUE_WORDS, True), **dict.fromkeys(FALSE_WORDS, False)}
_environ = os.environ


def _words(words: Iterable[str]) -> str:
    """``'a', 'b' or 'c'``."""
    quoted = [repr(w) for w in words]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def flag(name: str, default: bool) -> bool:
    """The switch ``name``: ``default`` when it is unset or empty, True for one of :data:`TRUE_WORDS`, False
    for one of :data:`FALSE_WORDS` (stripped, in any case). Anything else raises :class:`CommfuseValueError`
    naming the variable, the value and the words it takes."""
    raw = _environ.get(name)
    if not raw:
        return default
    value = _FLAG.get(raw.strip().lower())
    if value is None:
        if not raw.strip():
            return default
        raise CommfuseValueError(
            f"{name}={raw!r} is not a switch: give {_words(TRUE_WORDS)} for on, {_words(FALSE_WORDS)} for off "
            f"(in any case), or leave it unset or empty for its default ({'on' if default else 'off'})")
    return value


def choice(name: str, default, choices: Mapping[str, object] | Iterable[str]):
    """The word ``name`` takes, as the value ``choices`` gives it (a mapping from each word, lower case, to its
    value; a sequence of words stands for each word to itself); ``default`` when it is unset or empty. The
    value is stripped and lower-cased first. Anything else raises :class:`CommfuseValueError` naming the
    variable, the value and the words it takes."""
    raw = _environ.get(name)
    if not raw:
        return default
    word = raw.strip().lower()
    if not word:
        return default
    table = choices if isinstance(choices, Mapping) else {w: w for w in choices}
    try:
        return table[word]
    except KeyError:
        raise CommfuseValueError(
            f"{name}={raw!r} is not a value it takes: give {_words(table)} (in any case), or leave it unset or "
            "empty for its default") from None


def text(name: str, default=None, *, empty=None):
    """The variable ``name`` as text, stripped (a folder, a file or a name): ``default`` when it is unset;
    ``empty`` when it is empty or blank (``default`` unless given: ``COMMFUSE_PROFILE`` gives ``"off"``)."""
    raw = _environ.get(name)
    if raw is None:
        return default
    value = raw.strip()
    if value:
        return value
    return default if empty is None else empty


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def names(name: str) -> tuple[str, ...]:
    """The variable ``name`` as dotted names (``a.b``, ``c``) separated by commas, each stripped, in order,
    without repeats; ``()`` when it is unset or empty. Anything else (an empty item, a name that is not dotted
    words) raises :class:`CommfuseValueError` naming the variable, the value and the item."""
    raw = _environ.get(name, "")
    if not raw.strip():
        return ()
    items = [item.strip() for item in raw.split(",")]
    for item in items:
        if not _DOTTED.fullmatch(item):
            raise CommfuseValueError(
                f"{name}={raw!r}: {item!r} is not a dotted name: give names such as 'transformers' or 'a.b', "
                "separated by commas, or leave it unset or empty for none")
    return tuple(dict.fromkeys(items))


def number(name: str, default, low, high, *, kind=float, unit: str = "seconds"):
    """The variable ``name`` as a ``kind`` (float or int) from ``low`` to ``high``; ``default`` when it is unset
    or empty. Anything else raises :class:`CommfuseValueError` naming the variable, the value and the range."""
    text = _environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise CommfuseValueError(f"{name} must be a number of {unit}, got {text!r}") from None
    if not low <= value <= high:
        raise CommfuseValueError(f"{name}={text} is out of range: give {unit} from {low:g} to {high:g}")
    return value


#: The units :func:`size` reads after a number, in bytes (binary, as the allocators count).
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def size(name: str, default: int, low: int, high: int) -> int:
    """The variable ``name`` (``COMMFUSE_PLAN_BYTES``) as a number of bytes from ``low`` to ``high``: an integer, or a number followed by
    ``KiB``, ``MiB``, ``GiB`` or ``TiB`` (``512MiB``, ``1.5GiB``); ``default`` when it is unset or empty.
    Anything else raises :class:`CommfuseValueError` naming the variable, the value and the forms it takes."""
    text = _environ.get(name, "").strip()
    if not text:
        return default
    number = text.rstrip("BbIiKkMmGgTt ")
    unit = text[len(number):].strip().lower()
    try:
        value = int(float(number) * _UNITS[unit]) if unit else int(number)
    except (KeyError, ValueError, OverflowError):
        raise CommfuseValueError(
            f"{name} must be a number of bytes, alone or followed by KiB, MiB, GiB or TiB (such as 536870912 or "
            f"512MiB), got {text!r}"
        ) from None
    if not low <= value <= high:
        raise CommfuseValueError(f"{name}={text} is out of range: give bytes from {low} to {high}")
    return value
