"""A small parser for XLA's HLO text, and the dependency queries the traced backends' checks need.

Pure Python (no torch, no torch_xla, no jax), so the parser is tested anywhere,
and both traced lowerings check their graphs with it: the XLA backend's
(``commfuse_xla.verify``, what ``torch_xla._XLAC._get_xla_tensors_hlo``
prints) and the JAX backend's (``commfuse_jax.verify``, what
``jax.jit(...).lower(...).as_text(dialect="hlo")`` prints, whose ring sits in
the ``shard_map`` body computation, not in ENTRY). It reads an ``HloModule``
line, then computations, each a header ending in ``{`` and one instruction
per line::

    %collective-permute.7 = f32[4,8]{1,0} collective-permute(f32[4,8]{1,0} %add.6), source_target_pairs={{0,1},{1,0}}

An instruction has a name, a result shape (a tuple shape may nest), an
opcode, operands (names of other instructions in the same computation) and
attributes. Both the ``%name`` spelling and the newer bare ``name`` spelling
are accepted. The textual order of instructions is *not* the schedule: XLA
prints a topological order of its own choosing, so the checks work on the
dependency graph (:meth:`Computation.ancestors`), which is also all that XLA's
latency-hiding scheduler is bound by.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from commfuse.errors import CommfuseValueError


class HloParseError(CommfuseValueError):
    """HLO text that does not parse (the message quotes the line)."""


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    root: bool = False

    def attribute(self, key: str) -> str | None:
        """The raw text of attribute ``key`` (``source_target_pairs``, ``replica_groups`` ...), or None."""
        return _attribute(self.attributes, key)

    @property
    def source_target_pairs(self) -> tuple[tuple[int, int], ...]:
        text = self.attribute("source_target_pairs")
        if text is None:
            raise HloParseError(f"{self.name} ({self.opcode}) has no source_target_pairs")
        return tuple(tuple(p) for p in _int_lists(text))  # type: ignore[misc]

    @property
    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        text = self.attribute("replica_groups")
        return () if text is None else tuple(tuple(g) for g in _int_lists(text))


@dataclass
class Computation:
    name: str
    entry: bool
    instructions: dict[str, Instruction] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def add(self, ins: Instruction) -> None:
        if ins.name in self.instructions:
            raise HloParseError(f"computation {self.name} defines {ins.name} twice")
        self.instructions[ins.name] = ins
        self.order.append(ins.name)

    def of(self, opcode: str) -> list[Instruction]:
        """Instructions with ``opcode``, in textual order."""
        return [self.instructions[n] for n in self.order if self.instructions[n].opcode == opcode]

    @property
    def root(self) -> Instruction:
        roots = [i for i in self.instructions.values() if i.root]
        if len(roots) != 1:
            raise HloParseError(f"computation {self.name} has {len(roots)} ROOT instructions")
        return roots[0]

    def ancestors(self, name: str) -> set[str]:
        """Every instruction ``name`` depends on, transitively (not itself)."""
        cache = self.__dict__.setdefault("_ancestors", {})
        if name in cache:
            return cache[name]
        # Iterative post-order: HLO graphs of long rings are deep.
        stack = [(name, False)]
        while stack:
            node, expanded = stack.pop()
            if node in cache:
                continue
            operands = [o for o in self.instructions[node].operands if o in self.instructions]
            if expanded:
                found: set[str] = set()
                for o in operands:
                    found.add(o)
                    found |= cache[o]
                cache[node] = found
            else:
                stack.append((node, True))
                stack.extend((o, False) for o in operands if o not in cache)
        return cache[name]

    def depends(self, a: str, b: str) -> bool:
        """Whether ``a`` depends on ``b``."""
        return b in self.ancestors(a)

    def topological(self, names: list[str]) -> list[str]:
        """``names`` sorted so that every one comes after those it depends on (ties: textual order)."""
        position = {n: i for i, n in enumerate(self.order)}
        return sorted(names, key=lambda n: (len(self.ancestors(n) & set(names)), position[n]))


@dataclass
class Module:
    name: str
    computations: dict[str, Computation]

    @property
    def entry(self) -> Computation:
        entries = [c for c in self.computations.values() if c.entry]
        if len(entries) != 1:
            raise HloParseError(f"module {self.name} has {len(entries)} ENTRY computations")
        return entries[0]

    def holding(self, opcode: str) -> list[Computation]:
        """The computations with at least one ``opcode`` instruction, in textual order (a ``shard_map`` body
        holds the collectives of JAX's lowered HLO)."""
        return [c for c in self.computations.values() if c.of(opcode)]


_NAME = r"%?([A-Za-z_][\w.\-]*)"
_HEADER = re.compile(r"^\s*(ENTRY\s+)?" + _NAME + r"\s*(\(.*\))?\s*(->\s*.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?" + _NAME + r"\s*=\s*(.*)$")


def parse(text: str) -> Module:
    """Parse a module's HLO text; raises :class:`HloParseError` naming the line that does not parse."""
    lines = text.splitlines()
    module_name = ""
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("HloModule"):
            module_name = stripped.split()[1].rstrip(",")
            continue
        if current is None:
            m = _HEADER.match(line)
            if not m:
                raise HloParseError(f"line {number}: expected a computation header, got {stripped[:160]!r}")
            current = Computation(m.group(2), bool(m.group(1)))
            continue
        if stripped == "}":
            computations[current.name] = current
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            raise HloParseError(f"line {number}: expected an instruction, got {stripped[:160]!r}")
        try:
            current.add(_instruction(m.group(2), m.group(3), bool(m.group(1))))
        except HloParseError as e:
            raise HloParseError(f"line {number}: {e}: {stripped[:160]!r}") from None
    if current is not None:
        raise HloParseError(f"computation {current.name} is not closed by '}}'")
    if not computations:
        raise HloParseError("no computation found in the HLO text")
    return Module(module_name, computations)


def _instruction(name: str, rest: str, root: bool) -> Instruction:
    rest = rest.strip()
    # The result shape: a (possibly nested) tuple in parentheses, or one token such as f32[4,8]{1,0}.
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].strip()
    else:
        shape, _, rest = rest.partition(" ")
        rest = rest.strip()
    m = re.match(r"([a-z][\w\-]*)\(", rest)
    if not m:
        raise HloParseError(f"no opcode after the shape of {name}")
    opcode = m.group(1)
    start = m.end() - 1
    end = _closing(rest, start)
    inside, attributes = rest[start + 1 : end], rest[end + 1 :].lstrip(", ").strip()
    operands: tuple[str, ...] = ()
    if opcode not in ("constant", "parameter", "iota", "rng-get-and-update-state"):
        operands = tuple(_operand_name(part) for part in _split_top(inside) if part.strip())
    return Instruction(name, shape, opcode, operands, attributes, root)


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing ``text[start]`` (one of ``( { [``)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
    raise HloParseError(f"unbalanced {text[start]!r}")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas that are not inside brackets."""
    parts, depth, current = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return parts


def _operand_name(part: str) -> str:
    token = part.strip().split()[-1]
    return token[1:] if token.startswith("%") else token


def _attribute(attributes: str, key: str) -> str | None:
    for part in _split_top(attributes):
        k, sep, v = part.strip().partition("=")
        if sep and k.strip() == key:
            return v.strip()
    return None


def _int_lists(text: str) -> list[list[int]]:
    """``{{0,1},{1,2}}`` (or the ``[2,2]<=[4]`` iota form's explicit cousin) as lists of ints."""
    inner = text.strip()
    if not (inner.startswith("{") and inner.endswith("}")):
        raise HloParseError(f"expected a {{...}} list, got {text!r}")
    return [[int(x) for x in re.findall(r"-?\d+", g)] for g in re.findall(r"\{([^{}]*)\}", inner)]
