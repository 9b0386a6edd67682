"""Fingerprints in words: how the integers a call's fingerprint is made of read back, for every op.

A fingerprint (``compiled.Plan.fingerprint``) is a row of integers: :data:`FINGERPRINT_MAGIC`, the call's
number, the op's :func:`format_code`, its collective and algorithm (by their place in :data:`COLLECTIVES`
and :data:`ALGORITHMS`), then the op's own integers (``meta``: dtypes by :func:`dtype_code`, dims and
shapes), which may end with a layer's options (:func:`config_values`). The ranks compare these rows
(``groups.check_fingerprint``, which stays beside the exchange it runs); when they differ, this module
says what each rank called: :func:`describe_fingerprint` decodes the row, and the describer that its op
registered (:func:`register_format`, or :func:`register_described` for an op that may carry a layer's
options) reads the op's own integers.

One home for every describer that the lower layers know: the all-gather, reduce-scatter and all-to-all
forms' (by shards), the fused matmuls' and their backward rings' (written by :func:`gather_matmul_meta`,
read by its describer below it). Ops defined in the layers above (MoE, ``commfuse.graphs``, the
agreements) register theirs from their own modules. It sits at the bottom of the runtime, importing
only ``commfuse.schedule`` and ``commfuse.errors``, so that ``groups``, ``compiled`` and ``programs`` can all
import it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import torch

from commfuse.errors import CommfuseTypeError
from commfuse.schedule import Algorithm, Collective

__all__ = [
    "ALGORITHMS", "COLLECTIVES", "CONFIG_MARK", "FINGERPRINT_MAGIC", "config_values", "config_words",
    "describe_config", "describe_fingerprint", "dtype_code", "dtype_name", "format_code", "gather_matmul_meta",
    "register_described", "register_format", "shape_text",
]

#: The first integer of every fingerprint: a row that does not start with it was not made by this version.
FINGERPRINT_MAGIC = 0xC0F5

#: The order that codes collectives and algorithms in a fingerprint.
COLLECTIVES = list(Collective)
ALGORITHMS = list(Algorithm)


# -- dtypes and shapes ------------------------------------------------------------------------------------------

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else f"dtype#{code}"


def shape_text(code: int, shape: Sequence[int]) -> str:
    return f"{dtype_name(code)}{list(shape)}"


# -- an op's format -----------------------------------------------------------------------------------------------


_FORMATS: dict[int, tuple[str, object]] = {}


def format_code(label: str) -> int:
    """A stable small integer for an op label (the same on every rank running this version)."""
    return zlib.crc32(label.encode()) & 0xFFFFFF


def register_format(label: str, describe) -> None:
    """Say how ``describe(meta_values) -> str`` reads the fingerprint integers of op ``label``."""
    _FORMATS[format_code(label)] = (label, describe)


def describe_fingerprint(values: Sequence[int]) -> str:
    """A fingerprint in words, decoded with the format of the op that made it."""
    values = list(values)
    if len(values) < 8 or values[0] != FINGERPRINT_MAGIC:
        return f"an unrecognised fingerprint {values}"
    seq, code, coll, alg, overlap, parts, chunks = values[1:8]
    label, describe = _FORMATS.get(code, (f"op#{code}", None))
    coll_t = COLLECTIVES[coll].value if 0 <= coll < len(COLLECTIVES) else f"collective#{coll}"
    alg_t = ALGORITHMS[alg].value if 0 <= alg < len(ALGORITHMS) else f"algorithm#{alg}"
    if not overlap:
        alg_t = "serial"
    text = f"call #{seq} {label} ({coll_t}, algorithm {alg_t}, parts={parts}, chunks={chunks})"
    meta = values[8:]
    if describe is not None:
        try:
            return text + ": " + describe(meta)
        except Exception:  # noqa: BLE001 - a fingerprint that does not fit its format is shown raw
            pass
    return text + f": {meta}"


# -- a layer's options in a fingerprint ----------------------------------------------------------------------------
#
# A layer's options that change what its ranks compute or send but not the shapes (a causal mask, a bias, how
# many heads a width is cut into) travel at the end of its ops' fingerprints as ``[*values, count, code, MARK]``:
# ``code`` names the layer and its options' names (registered by :func:`config_values` on every rank that builds
# the same layer), so a mismatch reads back as ``ParallelAttention(causal=True, ...)`` on every rank.

#: The last integer of a fingerprint that ends with a layer's options.
CONFIG_MARK = 0x0C0F_C0F1
_CONFIGS: dict[int, tuple[str, tuple[str, ...], str]] = {}
_WORDS: dict[int, str] = {}  # a string option's value by its code (see config_words)


def _bits(value: float) -> int:
    """A float as the signed 64-bit integer of its IEEE bits (every rank compares the same bits)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def config_words(*words: str) -> None:
    """Say which strings a string option may take, so that a rank reads another rank's value back by name."""
    for word in words:
        _WORDS[zlib.crc32(word.encode())] = word


def config_values(layer: str, options: Sequence[tuple[str, object]]) -> tuple[int, ...]:
    """A layer's ``(name, value)`` options (bools, ints, floats, strings) as the integers that end its
    fingerprints."""
    names = tuple(name for name, _ in options)
    kinds, values = "", []
    for name, value in options:
        if isinstance(value, bool):
            kinds, value = kinds + "b", int(value)
        elif isinstance(value, int):
            kinds += "i"
        elif isinstance(value, float):
            kinds, value = kinds + "f", _bits(value)
        elif isinstance(value, str):
            config_words(value)
            kinds, value = kinds + "s", zlib.crc32(value.encode())
        else:
            raise CommfuseTypeError(f"{layer}: option {name}={value!r} must be a bool, an int, a float or a string "
                                    "to be compared across ranks")
        values.append(value)
    code = zlib.crc32(f"{layer}({','.join(names)}):{kinds}".encode()) & 0xFFFFFF
    _CONFIGS[code] = (layer, names, kinds)
    return (*values, len(values), code, CONFIG_MARK)


def describe_config(values: Sequence[int]) -> tuple[list[int], str | None]:
    """A fingerprint's op-specific integers split into (the op's own, the layer's options in words or None)."""
    values = list(values)
    if len(values) < 3 or values[-1] != CONFIG_MARK or not 0 <= values[-3] <= len(values) - 3:
        return values, None
    count, code = values[-3], values[-2]
    own, options = values[: len(values) - 3 - count], values[len(values) - 3 - count : -3]
    known = _CONFIGS.get(code)
    if known is None or len(known[1]) != count:
        return own, f"a layer's options {options} (a layer this rank did not build)"
    layer, names, kinds = known
    shown = [f"{name}={_shown(kind, v)}" for name, kind, v in zip(names, kinds, options)]
    return own, f"{layer}({', '.join(shown)})"


def _shown(kind: str, value: int) -> str:
    if kind == "b":
        return str(bool(value))
    if kind == "f":
        return repr(_float(value))
    if kind == "s":
        return repr(_WORDS.get(value, f"string#{value}"))
    return str(value)


def register_described(label: str, describe) -> None:
    """:func:`register_format` for an op whose fingerprints may end with a layer's
    options (:func:`config_values`): ``describe`` reads the op's own integers, the options are added in words."""
    def read(values):
        own, options = describe_config(values)
        text = describe(own)
        return text if options is None else f"{text}; {options}"

    register_format(label, read)


# -- how the ops' fingerprints read back -------------------------------------------------------------------------


def _describe_shards(what: str):
    def describe(v):
        return f"{what} {shape_text(v[0], v[3 : 3 + v[2]])} cut along dim {v[1]}"

    return describe


def gather_matmul_meta(a: torch.Tensor, bs, gd: int, total: int):
    """The fingerprint integers of an all-gather + matmul (of ``a`` gathered along ``gd`` to ``total`` rows,
    times each of ``bs``), as :func:`_describe_gather_matmul` reads them back: a function of no argument, as
    the ``meta`` of ``planning.gather.prepare_gather`` and ``gather_spans``, called only when a signature is first
    planned (a repeated call's backward ring finds its plan and builds nothing)."""
    def meta():
        full = list(a.shape)
        full[gd] = total
        return [dtype_code(a.dtype), gd, a.ndim, *full, len(bs)] + [d for bi in bs for d in bi.shape]

    return meta


def _describe_gather_matmul(v):
    ndim = v[2]
    shape, rest = v[3 : 3 + ndim], v[3 + ndim :]
    ws = [rest[1 + 2 * i : 3 + 2 * i] for i in range(rest[0])] if rest else []
    return f"a gathered along dim {v[1]} to {shape_text(v[0], shape)} times weights {ws}"


def _describe_matmul_scatter(v):
    ndim = v[2]
    return f"a {shape_text(v[0], v[3 : 3 + ndim])} times b {v[3 + ndim :]} scattered along dim {v[1]}"


def _describe_dgrad(v):
    return f"dgrad of {shape_text(v[0], v[2:])} along dim {v[1]}"


for _label, _shards in (
    ("all_gather_consume", "shards"), ("sharded_linear.forward", "weight shards"),
    ("sharded_linear.bias", "bias shards"), ("sharded_linear.dgrad", "weight shards"),
    ("produce_reduce_scatter", "partials"), ("produce_reduce_scatter.backward", "output gradient shards"),
    ("replicated_grad.reduce", "pieces of a replicated parameter's gradient"),
    ("replicated_grad.gather", "sums of a replicated parameter's gradient"),
    ("attention_reduce_scatter.backward", "output gradient shards"),
    ("sharded_linear.wgrad", "weight gradient partials"), ("sharded_linear.bgrad", "bias gradient partials"),
    ("all_to_all_consume", "chunks"), ("all_to_all_consume.uneven", "chunks (-1: rows differ per peer)"),
    ("produce_all_to_all", "blocks"),
    ("ulysses.kv", "key/value chunks"), ("ulysses.q", "query chunks"),
    ("ulysses.out", "output chunks"), ("ulysses.backward", "output gradient chunks"),
    ("ulysses.dq", "query gradient chunks"), ("ulysses.dkv", "key/value gradient chunks"),
):
    register_described(_label, _describe_shards(_shards))
for _label in ("all_gather_matmul", "all_gather_matmul.wgrad", "matmul_reduce_scatter.dgrad"):
    register_described(_label, _describe_gather_matmul)
register_described("matmul_reduce_scatter", _describe_matmul_scatter)
register_described("all_gather_matmul.dgrad", _describe_dgrad)
register_described("all_to_all.sizes", lambda v: f"{v[3]} row counts per rank")
