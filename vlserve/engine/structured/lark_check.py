"""Two facts about a Lark grammar the grammar engine does not check when it compiles one.

- Whether `start` can ever be finished: `start: "a" start` compiles, then forces "aaa..." until a limit of the
  engine stops it in the middle of an answer. A rule is productive when some alternative has only productive
  parts; the productive rules are found in linear time (each reference counted down once).
- The longest text one part forces (`"a"{1000000}`, a huge literal, `/x{99999}/`), as `checks.regex_min_run`
  reads regexes; and the most alternatives in one rule (over 2000, the engine fails on its first token).

It reads llguidance's Lark syntax after llguidance accepted the grammar, and gives no opinion (None) on what
it does not follow (imports, parametric or nested grammars, %if): those compile as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from vlserve.engine.structured.checks import regex_min_run

_TOKEN = re.compile(r"""
    (?P<skip>[ \t]+|(?:\#|//)[^\n]*)
  | (?P<nl>(?:\r?\n)+[ \t]*)
  | (?P<kw>%[a-z]+)
  | (?P<str>"(?:\\.|[^"\\])*"i?)
  | (?P<rx>/(?:\\.|[^/\\])+/[imslux]*)
  | (?P<special><[^<>\s]+>)
  | (?P<ref>@[a-zA-Z0-9_\-]+)
  | (?P<rule>!?[_?]?[a-z][_a-z0-9\-]*)
  | (?P<token>_?[A-Z][_A-Z0-9\-]*)
  | (?P<num>0[xX][0-9a-fA-F]+|[+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)
  | (?P<p>->|::|\.\.|[:,.(){}\[\]~|&=_+*?])
""", re.X)
_UNSUPPORTED = {"%import", "%override", "%declare", "%lark", "%if"}
_END_OF_EXPANSION = {"nl", "|", "->", "}", ")", "]", "&", "%if"}


class _NoOpinion(Exception):
    """Syntax this reader does not follow."""


@dataclass
class _Circuit:
    """AND/OR nodes over rules; a node fires (is productive) when all (AND) or any (OR) of its inputs do."""
    need: list[int] = field(default_factory=list)
    users: list[list[int]] = field(default_factory=list)
    rules: dict[str, int] = field(default_factory=dict)
    refs: list[tuple[str, int]] = field(default_factory=list)  # (rule name, node waiting on it)

    def node(self, inputs: list[int], any_input: bool) -> int:
        nid = len(self.need)
        self.need.append(min(1, len(inputs)) if any_input else len(inputs))
        self.users.append([])
        for i in inputs:
            self.users[i].append(nid)
        return nid

    def productive(self) -> set[int]:
        for name, nid in self.refs:  # a rule this grammar does not define: not ours to judge
            self.users[self.rules[name] if name in self.rules else self.node([], False)].append(nid)
        fired, ready = set(), [i for i, n in enumerate(self.need) if n == 0]
        while ready:
            nid = ready.pop()
            if nid in fired:
                continue
            fired.add(nid)
            for user in self.users[nid]:
                self.need[user] -= 1
                if self.need[user] == 0:
                    ready.append(user)
        return fired


class _Reader:
    def __init__(self, text: str):
        self.toks = _tokens(text)
        self.pos = 0
        self.c = _Circuit()
        self.most = 0  # the longest text one part forces
        self.widest = 0  # the most alternatives in one group of a rule (a terminal's are one regex: no matter)
        self.in_terminal = False

    def peek(self) -> str:
        return self.toks[self.pos][0] if self.pos < len(self.toks) else "eof"

    def take(self) -> tuple[str, str]:
        tok = self.toks[self.pos]
        self.pos += 1
        return tok

    def grammar(self) -> None:
        while self.peek() != "eof":
            kind, value = self.take()
            if kind == "nl":
                continue
            if kind == "rule":
                self.rule(value.lstrip("!?"))
            elif kind == "token" or value == "%ignore":  # lexemes: only their forced runs matter
                if kind == "token":
                    self.skip_to(":")
                self.in_terminal = True
                self.expansions()
                self.in_terminal = False
            elif value == "%llguidance":
                self.take()
            else:
                raise _NoOpinion(value)

    def skip_to(self, punct: str) -> None:
        while self.peek() != punct:
            kind, value = self.take()
            if value in ("{", "::"):  # templates and parametric rules (the end of the text: IndexError)
                raise _NoOpinion(value)
        self.take()

    def rule(self, name: str) -> None:
        self.skip_to(":")
        body, _ = self.expansions()
        self.c.rules[name] = self.c.node([body], any_input=True)

    def expansions(self) -> tuple[int, int]:
        """(OR node, shortest length) of `alias ('|' alias)*`, a newline before '|' allowed."""
        alts, shortest = [], None
        while True:
            node, length = self.alias()
            alts.append(node)
            shortest = length if shortest is None else min(shortest, length)
            if self.peek() == "|":
                self.take()
            elif self.peek() == "nl" and self.pos + 1 < len(self.toks) and self.toks[self.pos + 1][0] == "|":
                self.pos += 2
            else:
                if not self.in_terminal:
                    self.widest = max(self.widest, len(alts))
                return self.c.node(alts, any_input=True), shortest

    def alias(self) -> tuple[int, int]:
        parts, length = [self.expansion()], 0
        while self.peek() == "&":
            self.take()
            parts.append(self.expansion())
        if self.peek() == "->":
            self.pos += 2
        if self.peek() == "%if":
            raise _NoOpinion("%if")
        length = max(p[1] for p in parts)
        return self.c.node([p[0] for p in parts], any_input=False), length

    def expansion(self) -> tuple[int, int]:
        nodes, length = [], 0
        while self.peek() not in _END_OF_EXPANSION and self.peek() != "eof":
            node, n = self.expr()
            nodes.append(node)
            length += n
            self.most = max(self.most, length)
        return self.c.node(nodes, any_input=False), length

    def expr(self) -> tuple[int, int]:
        node, length = self.atom()
        low = 1
        kind = self.peek()
        if kind in ("*", "?"):
            self.take()
            low = 0
        elif kind == "+":
            self.take()
        elif kind == "~" and self.toks[self.pos + 1][0] == "num":
            self.take()
            low = int(self.take()[1])
            if self.peek() == "..":
                self.pos += 2
        elif kind == "{":
            self.take()
            low = int(self.take()[1]) if self.peek() == "num" else 0
            self.skip_to("}")
        self.most = max(self.most, length * max(low, 1))
        if low == 0:
            return self.c.node([], any_input=False), 0  # may be left out: always productive
        return node, length * low

    def atom(self) -> tuple[int, int]:
        kind, value = self.take()
        if kind == "~":  # a negated terminal: some text, of unknown length
            self.atom()
            return self.c.node([], False), 0
        if kind == "(":
            got = self.expansions()
            self.expect(")")
            return got
        if kind == "[":
            self.expansions()
            self.expect("]")
            return self.c.node([], False), 0
        if kind == "str":
            length = _string_length(value)
            if self.peek() == "..":  # "a".."z": one character
                self.pos += 2
                length = 1
            return self.c.node([], False), length
        if kind == "rx":
            shortest, most = regex_min_run(value[1:value.rindex("/")])
            self.most = max(self.most, most)
            return self.c.node([], False), shortest
        if kind == "rule":
            if self.peek() == "::" or (self.peek() == "{" and self.toks[self.pos + 1][0] not in ("num", ",")):
                raise _NoOpinion("template or parametric rule")
            nid = self.c.node([], any_input=True)
            self.c.need[nid] = 1
            self.c.refs.append((value.lstrip("!?"), nid))
            return nid, 0
        if kind in ("token", "special", "ref") or value in ("%json", "%regex"):
            if value in ("%json", "%regex"):
                self.take()
            return self.c.node([], False), 1 if kind == "special" else 0
        raise _NoOpinion(value)

    def expect(self, punct: str) -> None:
        if self.take()[0] != punct:
            raise _NoOpinion(punct)


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs; punctuation and keywords are their own kind. A %json / %regex / %llguidance body
    becomes one ("json", ...) token."""
    toks, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _NoOpinion(text[pos:pos + 20])
        pos = m.end()
        kind = m.lastgroup
        if kind == "skip":
            continue
        value = m.group()
        if kind == "kw" and value in _UNSUPPORTED:
            raise _NoOpinion(value)
        if kind in ("p", "kw"):
            kind = value
        toks.append((kind, value))
        if value in ("%json", "%regex", "%llguidance"):
            start = len(text) - len(text[pos:].lstrip())
            try:
                _, pos = decoder.raw_decode(text, start)
            except ValueError:
                raise _NoOpinion(value) from None
            toks.append(("json", ""))
    return toks


def _string_length(literal: str) -> int:
    body = literal[:-1] if literal.endswith("i") else literal
    try:
        return len(json.loads(re.sub(r"\\x([0-9a-fA-F]{2})", r"\\u00\1", body)))
    except ValueError:
        return len(body) - 2


@dataclass
class LarkFacts:
    never_finishes: list[str]  # rules (start first) no finite text matches; empty when start is fine
    longest_forced: int  # the most characters one part forces
    widest: int  # the most alternatives in one group of a rule


def lark_facts(text: str) -> LarkFacts | None:
    """What the checks above find in `text`, or None where the reader has no opinion."""
    try:
        reader = _Reader(text)
        reader.grammar()
    except (_NoOpinion, IndexError, ValueError, RecursionError):  # too deep to read here: the engine judges it
        return None
    if "start" not in reader.c.rules:
        return None
    fired = reader.c.productive()
    dead = [name for name, nid in reader.c.rules.items() if nid not in fired]
    if "start" in dead:
        dead.remove("start")
        dead.insert(0, "start")
    return LarkFacts(dead if "start" in dead else [], reader.most, reader.widest)
