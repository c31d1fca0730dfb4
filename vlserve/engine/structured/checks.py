"""What a constraint would cost, read from its text before anything compiles it (each check is linear in it).

The grammar engine builds its lexer lazily, so a part that forces a long run of text (`a{1000000}`, a huge
literal, `minItems: 1000000`) compiles at once and then fails, or slows every engine step, in the middle of an
answer. Such parts are refused here, by `GrammarLimits.max_min_length`. So are grammars with more rules than
`max_rules` (the GBNF converter's cost grows with them) and `choice` lists longer than `max_choices`.
"""

from __future__ import annotations

import json
import re

from vlserve.core.structured_outputs import GrammarLimits, StructuredOutputsError, StructuredOutputsParams

# A rule's head at the start of a line: GBNF `name ::=`, or Lark `name:` / `NAME:` (with the `!`/`?` prefixes,
# `.priority`, `[attributes]`, `{template params}` or `::_` Lark allows between the name and the colon).
_GBNF_RULE = re.compile(r"(?m)^[ \t]*[\w-]+[ \t]*::=")
_LARK_RULE = re.compile(r"(?m)^[ \t]*[!?]?[A-Za-z_][\w-]*(?:[ \t]*(?:\.[ \t]*-?\d+|\[[^\]\n]*\]|\{[^}\n]*\}|::_))*"
                        r"[ \t]*:(?!:)")
_JSON_MINIMA = ("minLength", "minItems", "minProperties", "minContains")


def check_spec(spec: StructuredOutputsParams, limits: GrammarLimits) -> None:
    """Raises StructuredOutputsError (400, naming the option that bounds it) for a spec over the limits."""
    kind, value = spec.kind, getattr(spec, spec.kind)
    longest = limits.max_min_length
    if kind == "choice":
        if len(value) > limits.max_choices:
            raise StructuredOutputsError(kind, f"has {len(value)} strings, over the limit of {limits.max_choices} "
                                               "(--structured-outputs-max-choices)")
        too_long = max(value, key=len)
        if len(too_long) > longest:
            raise _too_long(kind, f"a choice of {len(too_long)} characters", longest)
    elif kind == "regex":
        _, run = regex_min_run(value)
        if run > longest:
            raise _too_long(kind, f"a part that needs at least {run} characters", longest)
    elif kind == "json":
        problem = json_schema_problem(json.loads(value), longest)
        if problem is not None:
            raise _too_long(kind, problem, longest)
    elif kind == "grammar":
        rules = count_rules(value)
        if rules > limits.max_rules:
            raise StructuredOutputsError(kind, f"has {rules} rules, over the limit of {limits.max_rules} "
                                               "(--structured-outputs-max-rules)")


def _too_long(kind: str, what: str, limit: int) -> StructuredOutputsError:
    return StructuredOutputsError(kind, f"has {what}, over the limit of {limit} "
                                        "(--structured-outputs-max-min-length)")


def count_rules(text: str) -> int:
    gbnf = len(_GBNF_RULE.findall(text))
    return gbnf if gbnf else len(_LARK_RULE.findall(text))


def regex_min_run(pattern: str) -> tuple[int, int]:
    """(shortest match, most characters any part needs): the second is the largest minimum length over the
    sub-expressions (`x|a{1000}` -> 1000, `(ab){3}c` -> 7). Read loosely, never refusing: a regex this misreads
    is compiled (and refused, if bad) by the grammar engine."""
    # One frame per open group: [shortest finished alternative, length of the current one, length of its
    # last atom]. A quantifier multiplies the last atom; `)` turns the group into its parent's last atom.
    frames: list[list] = [[None, 0, 0]]
    most, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        frame = frames[-1]
        atom = None
        if c == "\\":
            atom, i = _escape(pattern, i)
        elif c == "[":
            i, atom = _class_end(pattern, i), 1
        elif c == "(":
            if pattern.startswith("?", i):
                j = i + 1
                while j < n and (pattern[j].isalpha() or pattern[j] == "-"):
                    j += 1
                if j < n and pattern[j] == ")":  # (?i): flags only, matches nothing
                    i, atom = j + 1, 0
                else:
                    if pattern.startswith("P<", j) or pattern.startswith("<", j):  # a named group
                        j = pattern.find(">", j)
                        j = n if j < 0 else j
                    i = j + 1
            if atom is None:
                frames.append([None, 0, 0])
                continue
        elif c == ")" and len(frames) > 1:
            done = frames.pop()
            atom, frame = _shortest(done), frames[-1]
        elif c == "|":
            frame[0], frame[1], frame[2] = _shortest(frame), 0, 0
            continue
        elif c in "*+?{":
            low, i = _quantifier(pattern, i, c)
            if low is not None:
                frame[1] += frame[2] * (low - 1)  # the atom was counted once already
                frame[2] *= low
                most = max(most, frame[2], frame[1])
                continue
            atom = 1  # a "{" that opens no count is a literal
        elif c in "^$":
            atom = 0
        else:
            atom = 1
        frame[1] += atom
        frame[2] = atom
        most = max(most, frame[1])
    return _shortest(frames[0]), most


def _shortest(frame: list) -> int:
    return frame[1] if frame[0] is None else min(frame[0], frame[1])


def _escape(pattern: str, i: int) -> tuple[int, int]:
    """(length, index after) of the escape whose backslash is before `i`."""
    if i >= len(pattern):
        return 1, i
    c = pattern[i]
    if c in "xupP" and pattern.startswith("{", i + 1):  # \x{10FFFF}, \p{Greek}
        end = pattern.find("}", i)
        return 1, len(pattern) if end < 0 else end + 1
    if c in "pP" and i + 1 < len(pattern):  # \pL
        return 1, i + 2
    return (0 if c in "bBAzZ<>" else 1), i + 1


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opened before `i` (classes nest in Rust's syntax)."""
    depth, n = 1, len(pattern)
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):  # a leading "]" is a literal
        i += 1
    while i < n and depth:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return i


_COUNT = re.compile(r"\{\s*(\d*)\s*(?:,\s*\d*\s*)?\}\??")


def _quantifier(pattern: str, i: int, c: str) -> tuple[int | None, int]:
    """(minimum count, index after) of the quantifier starting with `c` before `i`; None: not a quantifier."""
    if c == "{":
        m = _COUNT.match(pattern, i - 1)
        if m is None or not m.group(1):
            return None, i
        return int(m.group(1)[:12]), m.end()  # a longer count is refused as it is (int() refuses 4300 digits)
    if pattern.startswith("?", i):  # lazy: a*? a+? a??
        i += 1
    return (1 if c == "+" else 0), i


def json_schema_problem(schema, longest: int) -> str | None:
    """What in a JSON schema forces more than `longest` characters or items (walked, not resolved), or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key in _JSON_MINIMA:
            low = node.get(key)
            if isinstance(low, (int, float)) and not isinstance(low, bool) and low > longest:
                return f'"{key}": {low}'
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _, run = regex_min_run(pattern)
            if run > longest:
                return f"a pattern with a part that needs at least {run} characters"
        for key in ("const", "enum"):
            values = node.get(key) if key == "enum" else [node.get(key)]
            for v in values if isinstance(values, list) else ():
                if isinstance(v, str) and len(v) > longest:
                    return f'a "{key}" string of {len(v)} characters'
        stack.extend(v for k, v in node.items() if k not in ("const", "enum", "default", "examples"))
    return None
