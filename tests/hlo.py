"""Reading XLA's HLO text: what the body of a program's top-level loop holds.

A `lax.scan` is a `while` instruction of the entry computation; its body calls other
computations (fusions, `call`s, reductions), which are counted with it.
"""

import collections
import re


# A computation's first line: `name {`, or `name (parameters) -> result {`.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) (?:.* )?\{$")
# An instruction: `name = type opcode(operands), attributes`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*?\s([a-z][\w\-]*)\(")
_CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's lines by name, and the entry computation's name."""
    found: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current = match.group(1)
                found[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            found[current].append(line)
    return found, entry


def _opcode(line: str) -> str | None:
    match = _INSTRUCTION.match(line)
    return None if match is None else match.group(1)


def _called(line: str) -> list[str]:
    names = []
    for single, several in _CALLED.findall(line):
        names += [single] if single else [n.strip(" %") for n in several.split(",")]
    return names


def loop_body_lines(hlo: str) -> list[str]:
    """The instructions that the bodies of the entry computation's `while` loops hold,
    with those of every computation they call."""
    found, entry = computations(hlo)
    # The loops of the entry computation, or of a `call` it makes (XLA's CPU
    # compiler wraps a small program's loop in one).
    outer, todo = [entry], []
    while outer:
        for line in found[outer.pop()]:
            if _opcode(line) == "while":
                todo += re.findall(r"body=%?([\w.\-]+)", line)
            elif _opcode(line) == "call":
                outer += _called(line)
    assert todo, "the entry computation holds no while loop"
    seen: set[str] = set()
    lines: list[str] = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in found[name]:
            if _opcode(line) is not None:
                lines.append(line)
            todo += _called(line)
    return lines


def loop_body_ops(hlo: str) -> collections.Counter:
    """The opcodes of `loop_body_lines`, counted."""
    return collections.Counter(_opcode(line) for line in loop_body_lines(hlo))
