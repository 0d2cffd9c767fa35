"""The kernels an optimised XLA GPU executable launches, read from its HLO text.

A scanned step runs its layer block once per pass of a while loop, so the census counts the
entry computation's launches and one pass of each loop body, and multiplies by the loop's
known trip count: the number of kernels a step launches, by kind, without running it (what a
kernel table of the profiled step counts, from the compiled program alone). ``serve.py
--census`` prints it for each decode row.

Kinds: ``pallas <name>`` (a Mosaic GPU kernel, named by the op it implements), ``cublas``,
``xla loop`` / ``xla reduction`` (XLA's own fusions), ``triton`` (XLA's Triton fusions),
``copy`` (a copy, or an asynchronous slice copy), or the instruction's opcode.
"""

from __future__ import annotations

import collections
import dataclasses
import re

__all__ = ["Census", "census"]

_HEADER = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
# Instructions that launch nothing themselves: views, tuples, constants, the ends of
# asynchronous pairs (the start launched) and control flow (its computations launch).
_NO_LAUNCH = frozenset(
    "parameter get-tuple-element tuple bitcast constant after-all partition-id replica-id "
    "copy-done fusion-done async-done send-done recv-done all-reduce-done all-gather-done "
    "collective-permute-done while conditional call opt-barrier".split()
)
_CONTROL = re.compile(r"(?:body|condition|to_apply|true_computation|false_computation)=(%[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Census:
    """``outside``: kinds launched once a step (the entry computation and what it calls
    outside loops); ``loops``: per while loop, its trip count (0 if unknown) and the kinds
    one pass launches."""

    outside: collections.Counter
    loops: tuple[tuple[int, collections.Counter], ...]

    @property
    def total(self) -> int:
        """Kernels a step launches (a loop of unknown trip count counted once)."""
        return sum(self.outside.values()) + sum(
            max(trips, 1) * sum(kinds.values()) for trips, kinds in self.loops
        )

    def describe(self) -> str:
        """One line: the total, then each loop's pass by kind."""
        parts = [f"{self.total} kernels a step, {sum(self.outside.values())} outside loops"]
        for trips, kinds in self.loops:
            listed = ", ".join(f"{kind} {n}" for kind, n in kinds.most_common())
            parts.append(f"{trips or '?'} passes of {sum(kinds.values())} ({listed})")
        return "; ".join(parts)


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines, and the entry computation's name."""
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(line)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return bodies, entry


def _custom_call_kind(rest: str) -> str:
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    name = target.group(1) if target else "?"
    if name.startswith("mosaic_gpu"):
        op = re.search(r'op_name="([^"]+)"', rest)
        steps = [s for s in (op.group(1).split("/") if op else []) if s != "mpmd_map"]
        return f"pallas {steps[-1] if steps else '?'}"
    if "cublas" in name:
        return "cublas"
    return f"custom-call {name}"


def _fusion_kind(rest: str, bodies: dict[str, list[str]]) -> str:
    called = re.search(r"calls=(%[\w.\-]+)", rest)
    inner = bodies.get(called.group(1), []) if called else []
    for line in inner:  # a dynamic-slice fusion launches its hero, with sliced operands
        m = _INSTRUCTION.match(line)
        if m and m.group(3) == "custom-call":
            return _custom_call_kind(m.group(4))
    if "__triton" in rest:
        return "triton"
    if "kind=kInput" in rest:
        return "xla reduction"
    if "kind=kLoop" in rest:
        return "xla loop"
    return "xla fusion"


def _kind(opcode: str, rest: str, bodies: dict[str, list[str]]) -> str | None:
    if opcode in _NO_LAUNCH:
        return None
    if opcode == "custom-call":
        return _custom_call_kind(rest)
    if opcode == "fusion":
        return _fusion_kind(rest, bodies)
    if opcode == "fusion-start":
        return "copy" if "dynamic_slice" in rest else _fusion_kind(rest, bodies)
    if opcode in ("copy", "copy-start"):
        return "copy"
    return opcode


def census(text: str) -> Census:
    """The launches of the executable whose optimised HLO is ``text``
    (``Compiled.as_text()``)."""
    bodies, entry = _computations(text)
    outside: collections.Counter = collections.Counter()
    loops: list[tuple[int, collections.Counter]] = []

    def walk(name: str, into: collections.Counter) -> None:
        for line in bodies.get(name, []):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            opcode, rest = m.group(3), m.group(4)
            if opcode == "while":
                body = re.search(r"body=(%[\w.\-]+)", rest)
                condition = re.search(r"condition=(%[\w.\-]+)", rest)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                kinds: collections.Counter = collections.Counter()
                if body:
                    walk(body.group(1), kinds)
                if condition:
                    walk(condition.group(1), kinds)
                loops.append((int(trips.group(1)) if trips else 0, kinds))
                continue
            if opcode in ("conditional", "call"):
                called = _CONTROL.findall(rest)
                branches = _BRANCHES.search(rest)
                if branches:
                    called += [b.strip() for b in branches.group(1).split(",")]
                for computation in called:
                    walk(computation, into)
                continue
            kind = _kind(opcode, rest, bodies)
            if kind is not None:
                into[kind] += 1

    walk(entry, outside)
    return Census(outside, tuple(loops))
