"""Hardware profiles: the numbers the cost model runs on, read from TOML.

A profile describes one accelerator and the links between accelerators of
its kind. It is a frozen record validated on creation: every field is checked
and an error names the file, the section and the field, and what it should
have been. Unknown keys are refused (a typo would otherwise be silently
ignored). The shipped profiles live in ``commfuse/sim/profiles/*.toml``; a
profile written by ``commfuse simulate calibrate`` has the same format.

Format (every number in SI units: flop/s, bytes/s, seconds)::

    name = "h100-sxm"
    description = "..."

    [compute]
    dtype = "bfloat16"            # the element type the rates are for
    peak_flops = 989.4e12         # dense peak of the matrix units
    memory_bandwidth = 3.35e12    # bytes/s
    efficiency = 0.70             # fraction of peak a large GEMM reaches
    half_efficiency_flops = 4e9   # a kernel this big reaches half of `efficiency`

    [link]
    topology = "switch"           # "switch" | "direct" | "bus"
    duplex = "full"               # "full" | "half"
    bandwidth = 450e9             # bytes/s, per direction of one port or link
    efficiency = 0.80             # fraction of `bandwidth` a large message gets
    latency = 8e-6                # seconds per message (per ring hop)
    burst = 0                     # bytes a token bucket lets through at once after a pause (tc tbf)

    [collective]                  # whole collectives (vanilla / sliced)
    latency = 8e-6                # per ring step; default: link.latency
    efficiency = 1.0              # relative to a point-to-point ring step
    reduce_scatter_efficiency = 1.0   # default: efficiency

    [host]
    step_overhead = 4e-6          # per schedule step (the executor's own time)
    call_overhead = 1e-5          # per op call

    [contention]
    compute_slowdown = 0.10       # compute takes 10% longer while a transfer is in flight

    [match]
    device_names = ["H100"]       # device-name substrings that select this profile for `auto`

See ``docs/simulator.md`` for what each number means in the model.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from commfuse.errors import CommfuseValueError
from commfuse.runtime.env import text as env_text

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 with the tomli backport
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

#: Folder of the profiles shipped in the package.
PROFILE_DIR = Path(__file__).with_name("profiles")

TOPOLOGIES = ("switch", "direct", "bus")
DUPLEX = ("full", "half")
#: Element types and their size in bytes.
DTYPES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}

# Bounds on a profile's numbers, checked when one is made (loaded, replaced, calibrated). Each is far outside
# any device or link there is, so a real profile never meets one; together they keep the model's arithmetic
# finite: with every size of a workload within ``commfuse.sim._workloads.MAX_DIM`` (2**32) no kernel exceeds
# ~1e49 flops or ~1e40 bytes, and no rate or divisor falls under 1e-3, so every time stays below ~1e55 s and
# no division is by zero, where 1e308 s of latency or 5e-324 flop/s made an inf/NaN table.
#: flop/s of one device: a microcontroller's to 200x a B200's dense FP8 (~5e15).
PEAK_FLOPS_RANGE = (1e6, 1e18)
#: bytes/s of device memory: 1 MB/s to 100x HBM3e (~8e12).
MEMORY_BANDWIDTH_RANGE = (1e6, 1e15)
#: bytes/s of a link, per direction: 8 kbit/s (a tc-shaped test loopback) to 100x NVLink 5 (~9e11).
LINK_BANDWIDTH_RANGE = (1e3, 1e14)
#: The least fraction of peak, of a link's rate or of a ring step a profile may claim (what a kernel, a message
#: or a collective is divided by).
MIN_EFFICIENCY = 1e-3
#: Seconds a message, a ring step, a schedule step or an op call may cost at most: a geostationary round trip
#: is 0.6 s.
MAX_LATENCY_S = 10.0
#: The flops at which a kernel reaches half its efficiency, at most: a whole large training step's GEMM.
MAX_HALF_EFFICIENCY_FLOPS = 1e18
#: Bytes a token bucket may let through at once: 1 TB.
MAX_BURST_BYTES = 1e12
#: The largest profile file read: a profile is a few KB of TOML; anything bigger is not one.
MAX_PROFILE_BYTES = 1 << 20


class ProfileError(CommfuseValueError):
    """A profile is missing, malformed, or has a field with a bad value."""


def _number(where: str, name: str, value, *, positive: bool = False, low: float | None = None,
            high: float | None = None, unit: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where}: {name} must be a number{unit}, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an integer past what a float holds
        raise ProfileError(f"{where}: {name} must be a number a float can hold{unit}, got an integer of "
                           f"{value.bit_length()} bits") from None
    if not math.isfinite(value):
        raise ProfileError(f"{where}: {name} must be finite, got {value!r}")
    if positive and not value > 0:
        raise ProfileError(f"{where}: {name} must be > 0{unit}, got {value!r}")
    if low is not None and value < low:
        raise ProfileError(f"{where}: {name} must be >= {low:g}{unit}, got {value!r}")
    if high is not None and value > high:
        raise ProfileError(f"{where}: {name} must be <= {high:g}{unit}, got {value!r}")
    return value


def _choice(where: str, name: str, value, choices) -> str:
    if value not in choices:
        raise ProfileError(f"{where}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


@dataclass(frozen=True)
class ComputeSpec:
    """How fast one device computes: a roofline with an efficiency curve.

    A kernel of ``F`` flops touching ``B`` bytes takes
    ``max(F / (peak_flops * eff(F)), B / memory_bandwidth)`` with
    ``eff(F) = efficiency * F / (F + half_efficiency_flops)``: large kernels
    reach ``efficiency`` of peak, small ones fall off (launch cost, tile
    quantisation), which is what makes over-slicing lose.
    """

    peak_flops: float
    memory_bandwidth: float
    efficiency: float = 1.0
    half_efficiency_flops: float = 0.0
    dtype: str = "bfloat16"

    def _check(self, where: str) -> None:
        _number(where, "[compute].peak_flops", self.peak_flops, positive=True, low=PEAK_FLOPS_RANGE[0],
                high=PEAK_FLOPS_RANGE[1], unit=" flop/s")
        _number(where, "[compute].memory_bandwidth", self.memory_bandwidth, positive=True,
                low=MEMORY_BANDWIDTH_RANGE[0], high=MEMORY_BANDWIDTH_RANGE[1], unit=" bytes/s")
        _number(where, "[compute].efficiency", self.efficiency, positive=True, low=MIN_EFFICIENCY, high=1.0)
        _number(where, "[compute].half_efficiency_flops", self.half_efficiency_flops, low=0.0,
                high=MAX_HALF_EFFICIENCY_FLOPS, unit=" flops")
        _choice(where, "[compute].dtype", self.dtype, tuple(DTYPES))


@dataclass(frozen=True)
class LinkSpec:
    """The point-to-point links between devices.

    ``topology``: ``switch`` (every device has one port into a non-blocking
    switch: NVSwitch, a network switch), ``direct`` (a dedicated link between
    every pair that talks: torus neighbours, a full mesh), ``bus`` (one shared
    medium for every message: a rate-limited loopback). ``duplex``: ``full``
    (the two directions of a port or link do not share bandwidth) or ``half``
    (they do). Concurrent messages on one port, link or bus share its
    bandwidth equally. ``burst``: a token bucket of that many bytes, refilled
    at the link's rate while the link is idle, that lets the first bytes after
    a pause through at once (a link shaped by ``tc tbf``; 0 for real links).
    """

    bandwidth: float
    latency: float
    topology: str = "switch"
    duplex: str = "full"
    efficiency: float = 1.0
    burst: float = 0.0

    def _check(self, where: str) -> None:
        _number(where, "[link].bandwidth", self.bandwidth, positive=True, low=LINK_BANDWIDTH_RANGE[0],
                high=LINK_BANDWIDTH_RANGE[1], unit=" bytes/s")
        _number(where, "[link].latency", self.latency, low=0.0, high=MAX_LATENCY_S, unit=" s")
        _number(where, "[link].burst", self.burst, low=0.0, high=MAX_BURST_BYTES, unit=" bytes")
        _choice(where, "[link].topology", self.topology, TOPOLOGIES)
        _choice(where, "[link].duplex", self.duplex, DUPLEX)
        _number(where, "[link].efficiency", self.efficiency, positive=True, low=MIN_EFFICIENCY, high=1.0)

    @property
    def rate(self) -> float:
        """Bytes/s one message gets when it has the port or link to itself."""
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class CollectiveSpec:
    """Whole collectives (``vanilla``, ``sliced``) at their standard ring cost.

    A collective over N ranks whose per-rank piece is S bytes takes
    ``(N - 1) * (latency + S / (efficiency * r))`` where ``r`` is the rate of
    one message of a ring step under the link model (every rank sending to its
    neighbour at once). ``latency`` None means the link's latency;
    ``reduce_scatter_efficiency`` None means ``efficiency`` (a library whose
    reduce-scatter moves more than the ring's bytes, as gloo's does, gets its
    own).
    """

    latency: float | None = None
    efficiency: float = 1.0
    reduce_scatter_efficiency: float | None = None

    def _check(self, where: str) -> None:
        if self.latency is not None:
            _number(where, "[collective].latency", self.latency, low=0.0, high=MAX_LATENCY_S, unit=" s")
        _number(where, "[collective].efficiency", self.efficiency, positive=True, low=MIN_EFFICIENCY, high=4.0)
        if self.reduce_scatter_efficiency is not None:
            _number(where, "[collective].reduce_scatter_efficiency", self.reduce_scatter_efficiency, positive=True,
                    low=MIN_EFFICIENCY, high=4.0)

    def efficiency_of(self, collective: str) -> float:
        if collective == "reduce_scatter" and self.reduce_scatter_efficiency is not None:
            return self.reduce_scatter_efficiency
        return self.efficiency


@dataclass(frozen=True)
class HostSpec:
    """Time the executor itself takes: per step (post, wait, bookkeeping) and per op call."""

    step_overhead: float = 0.0
    call_overhead: float = 0.0

    def _check(self, where: str) -> None:
        _number(where, "[host].step_overhead", self.step_overhead, low=0.0, high=MAX_LATENCY_S, unit=" s")
        _number(where, "[host].call_overhead", self.call_overhead, low=0.0, high=MAX_LATENCY_S, unit=" s")


@dataclass(frozen=True)
class ContentionSpec:
    """Compute slows by ``compute_slowdown`` (0.1 = takes 10% longer) while a transfer of its rank is in flight."""

    compute_slowdown: float = 0.0

    def _check(self, where: str) -> None:
        _number(where, "[contention].compute_slowdown", self.compute_slowdown, low=0.0, high=10.0)


_SECTIONS = {
    "compute": ComputeSpec,
    "link": LinkSpec,
    "collective": CollectiveSpec,
    "host": HostSpec,
    "contention": ContentionSpec,
}


@dataclass(frozen=True)
class Profile:
    """One device kind and its links; see the module docstring for the TOML form."""

    name: str
    compute: ComputeSpec
    link: LinkSpec
    collective: CollectiveSpec = field(default_factory=CollectiveSpec)
    host: HostSpec = field(default_factory=HostSpec)
    contention: ContentionSpec = field(default_factory=ContentionSpec)
    description: str = ""
    device_names: tuple[str, ...] = ()
    #: Where the profile was read from (informational; not part of equality).
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}" + (f" ({self.source})" if self.source else "")
        if not isinstance(self.name, str) or not self.name:
            raise ProfileError(f"{where}: name must be a non-empty string, got {self.name!r}")
        for section, cls in _SECTIONS.items():
            value = getattr(self, section)
            if not isinstance(value, cls):
                raise ProfileError(f"{where}: [{section}] must be a {cls.__name__}, got {type(value).__name__}")
            value._check(where)
        if not isinstance(self.description, str):
            raise ProfileError(f"{where}: description must be a string, got {self.description!r}")
        names = self.device_names
        if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
            raise ProfileError(f"{where}: [match].device_names must be a list of non-empty strings, got {names!r}")
        object.__setattr__(self, "device_names", tuple(names))

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.compute.dtype]

    @property
    def collective_latency(self) -> float:
        return self.link.latency if self.collective.latency is None else self.collective.latency

    def replace(self, **changes) -> "Profile":
        """A copy with fields changed; keys are ``"section.field"`` (or ``name``), e.g. ``{"link.bandwidth": 1e9}``.

        Also takes them as a dict: ``profile.replace(**{"link.latency": 0})``.
        """
        top: dict = {}
        per: dict[str, dict] = {}
        for key, value in changes.items():
            section, _, name = key.partition(".")
            if not name:
                if section not in ("name", "description", "device_names"):
                    raise ProfileError(f"profile {self.name!r}: cannot set {key!r}; use 'section.field', e.g. "
                                       f"'link.bandwidth'")
                top[section] = value
                continue
            if section not in _SECTIONS:
                raise ProfileError(f"profile {self.name!r}: unknown section {section!r} in {key!r}; "
                                   f"sections are {', '.join(_SECTIONS)}")
            names = {f.name for f in dataclasses.fields(_SECTIONS[section])}
            if name not in names:
                raise ProfileError(f"profile {self.name!r}: [{section}] has no field {name!r}; it has "
                                   f"{', '.join(sorted(names))}")
            per.setdefault(section, {})[name] = value
        for section, values in per.items():
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def to_toml(self, comments: dict[str, str] | None = None, header: str = "") -> str:
        """The profile as TOML; ``comments`` maps ``"section.field"`` to a note written beside the value."""
        comments = comments or {}
        lines = [f"# {line}".rstrip() for line in header.splitlines()] if header else []
        if lines:
            lines.append("")

        def put(key: str, value, note_key: str) -> None:
            text = f"{key} = {_toml_value(value)}"
            note = comments.get(note_key)
            lines.append(f"{text:<40} # {note}" if note else text)

        put("name", self.name, "name")
        put("description", self.description, "description")
        for section, cls in _SECTIONS.items():
            lines += ["", f"[{section}]"]
            spec = getattr(self, section)
            for f in dataclasses.fields(cls):
                value = getattr(spec, f.name)
                if value is None:
                    continue
                put(f.name, value, f"{section}.{f.name}")
        if self.device_names:
            lines += ["", "[match]"]
            put("device_names", list(self.device_names), "match.device_names")
        return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        text = f"{value:.6g}"
        if float(text) != value:  # keep every digit that matters: the file must load back to the same profile
            text = repr(value)
        return text if any(c in text for c in ".einf") else text + ".0"
    return str(value)


def from_dict(data: dict, source: str = "") -> Profile:
    """A :class:`Profile` from parsed TOML; every error names ``source``, the section and the field."""
    where = f"profile {source}" if source else "profile"
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a table, got {type(data).__name__}")
    known_top = {"name", "description", "match", *_SECTIONS}
    extra = sorted(set(data) - known_top)
    if extra:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(map(repr, extra))}; a profile has "
                           f"{', '.join(sorted(known_top))}")
    for required in ("name", "compute", "link"):
        if required not in data:
            what = f"[{required}] section" if required != "name" else "name"
            raise ProfileError(f"{where}: missing {what}")
    name = data["name"]
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}: name must be a non-empty string, got {name!r}")
    where = f"profile {name!r}" + (f" ({source})" if source else "")
    sections = {}
    for section, cls in _SECTIONS.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ProfileError(f"{where}: [{section}] must be a table, got {type(table).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        extra = sorted(set(table) - set(fields))
        if extra:
            raise ProfileError(f"{where}: [{section}] has unknown field(s) {', '.join(map(repr, extra))}; "
                               f"it has {', '.join(sorted(fields))}")
        missing = [n for n, f in fields.items()
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in table]
        if missing:
            raise ProfileError(f"{where}: [{section}] is missing {', '.join(missing)}")
        sections[section] = cls(**table)
    match = data.get("match", {})
    if not isinstance(match, dict) or set(match) - {"device_names"}:
        raise ProfileError(f"{where}: [match] may only hold device_names, got {match!r}")
    names = match.get("device_names", [])
    if isinstance(names, str) or not isinstance(names, list):
        raise ProfileError(f"{where}: [match].device_names must be a list of strings, got {names!r}")
    description = data.get("description", "")
    return Profile(name=name, description=description, device_names=tuple(names), source=source, **sections)


def shipped() -> list[str]:
    """Names of the profiles shipped with commfuse."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def user_dir() -> Path:
    """Where ``calibrate --install`` puts profiles: ``$COMMFUSE_PROFILE_DIR``, else ``~/.config/commfuse/profiles``."""
    env = env_text("COMMFUSE_PROFILE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "commfuse" / "profiles"


def load_profile(spec: "str | os.PathLike | Profile") -> Profile:
    """A profile by shipped name, by installed name (``user_dir()``), or from a TOML file path."""
    if isinstance(spec, Profile):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise ProfileError(f"a profile is a name or a path to a TOML file, got {type(spec).__name__} {spec!r}")
    text = os.fspath(spec)
    path = Path(text)
    looks_like_path = text.endswith(".toml") or os.sep in text or (os.altsep and os.altsep in text)
    if not looks_like_path:
        for folder in (PROFILE_DIR, user_dir()):
            candidate = folder / f"{text}.toml"
            if candidate.is_file():
                path = candidate
                break
        else:
            installed = sorted(p.stem for p in user_dir().glob("*.toml")) if user_dir().is_dir() else []
            raise ProfileError(
                f"no profile named {text!r}; shipped: {', '.join(shipped())}"
                + (f"; installed in {user_dir()}: {', '.join(installed)}" if installed else "")
                + " (or give the path of a .toml file)"
            )
    if not os.path.lexists(path):
        raise ProfileError(f"profile file {text!r} does not exist")
    if not path.is_file():
        raise ProfileError(f"profile file {text!r} is not a regular file (a folder, a device, a broken link)")
    if tomllib is None:  # pragma: no cover
        raise ProfileError(f"reading profile {path} needs Python 3.11 (tomllib) or `pip install tomli`")
    return from_dict(_parse(path), source=str(path))


def _parse(path: Path) -> dict:
    """The TOML table in ``path``; every way a file can fail to be one is a :class:`ProfileError` naming it."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise ProfileError(f"profile file {path} cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"profile file {path} is over {MAX_PROFILE_BYTES} bytes; a profile is a few KB of TOML")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProfileError(f"profile file {path} is not UTF-8 text (TOML is): byte {e.start} is {raw[e.start]:#04x}"
                           ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"profile file {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ProfileError(f"profile file {path} nests arrays or tables too deeply to read (a profile is flat)"
                           ) from None
    except ValueError as e:  # a number the parser refuses to convert (e.g. an integer over 4300 digits)
        raise ProfileError(f"profile file {path} is not valid TOML: {e}") from None
