r"""A `StructuredOutputsParams` -> an llguidance grammar, checked against `GrammarLimits` (cached by its users).

llguidance (not xgrammar): one dependency-free wheel (xgrammar pulls triton and a TVM runtime), grammars are
built lazily so even big schemas need no ahead-of-time compile, it reads both Lark and GBNF grammars, and
its matchers roll back and fill batch masks on their own threads without the GIL.

Regexes mean what vLLM's users expect (xgrammar, outlines and Python's re.ASCII read them so): `\d` is `[0-9]`,
`\w` is `[0-9A-Za-z_]`, `\s` is `[ \t\n\r\f\v]`, and `\D` `\W` `\S` their complements, not the Unicode classes
of llguidance's Rust syntax (where `\d{3}` admits "߄٩0"). That holds for `regex` and for the `/.../` terminals
of a Lark grammar (GBNF has no such escapes). A JSON schema's "pattern" follows ECMAScript, as JSON Schema
says and llguidance already does: `\d` and `\w` are ASCII there, `\s` is Unicode whitespace.
"""

from __future__ import annotations

import json
import re
import time

import llguidance

from vlserve.core.structured_outputs import GrammarLimits, StructuredOutputsError, StructuredOutputsParams
from vlserve.engine.structured.checks import check_spec
from vlserve.engine.structured.gbnf import any_to_lark
from vlserve.engine.structured.lark_check import lark_facts

# JSON without free whitespace: "," and ":" exactly, so a model cannot spend its tokens on spaces.
COMPACT_JSON = {"whitespace_flexible": False}
FLEXIBLE_JSON = {"whitespace_flexible": True}
DEFAULT_LIMITS = GrammarLimits()
MAX_ITEMS_IN_ROW = llguidance.LLParserLimits().max_items_in_row  # 2000: one rule's alternatives at most


def parser_limits() -> llguidance.LLParserLimits:
    """The grammar engine's own limits (fuel for its lexer, grammar size, Earley items per step) at their
    defaults; errors without the parser's state and the tokens so far, which a client has no use for."""
    return llguidance.LLParserLimits(verbose_errors=False)


def grammar_for(spec: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    """The llguidance grammar of `spec`; StructuredOutputsError (400) with the reason if it is over `limits`,
    cannot compile, can never be finished, or took longer than `limits.compile_timeout` to compile."""
    started = time.monotonic()
    kind = spec.kind
    check_spec(spec, limits)
    try:
        if kind == "grammar":
            lark = _grammar_to_lark(spec.grammar)
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            json_options = COMPACT_JSON if spec.disable_any_whitespace else FLEXIBLE_JSON
            grammar = _BUILDERS[kind](getattr(spec, kind), json_options)
    except ValueError as e:  # not JSON, or a GBNF grammar the converter cannot read
        raise StructuredOutputsError(kind, f"cannot be compiled: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise StructuredOutputsError(kind, f"cannot be compiled: {error.strip()[:2000]}")
    if kind == "grammar":
        _check_lark(lark, limits)
    check_time(kind, started, limits)
    return grammar


class CompileTimeout(StructuredOutputsError):
    """Over the time budget: not a fact about the spec (a busy host is slower), so never cached as its outcome."""


def cacheable(e: StructuredOutputsError) -> StructuredOutputsError | None:
    """What a cache of outcomes may keep of `e`: without its traceback (whose frames hold the grammar and
    matchers), and nothing for a timeout."""
    return None if isinstance(e, CompileTimeout) else e.for_field(e.field)  # a fresh copy: `e` is being raised


def check_time(kind: str, started: float, limits: GrammarLimits) -> None:
    took = time.monotonic() - started
    if took > limits.compile_timeout:
        raise CompileTimeout(kind, f"took {took:.1f}s to compile, over the limit of "
                                           f"{limits.compile_timeout:g}s (--structured-outputs-compile-timeout)")


def _check_lark(lark: str, limits: GrammarLimits) -> None:
    facts = lark_facts(lark)
    if facts is None:
        return
    if facts.never_finishes:
        others = facts.never_finishes[1:6]
        also = f" (rules that never end: {', '.join(others)})" if others else ""
        raise StructuredOutputsError("grammar", "can never be finished: no finite text matches its start rule, "
                                                f"every alternative recurses without end{also}")
    if facts.widest > MAX_ITEMS_IN_ROW:
        raise StructuredOutputsError("grammar", f"has a rule with {facts.widest} alternatives; the grammar engine "
                                                f"takes at most {MAX_ITEMS_IN_ROW} at a time: make them a terminal "
                                                '(NAME: "a" | "b" | ...)')
    if facts.longest_forced > limits.max_min_length:
        raise StructuredOutputsError("grammar", f"has a part that needs at least {facts.longest_forced} "
                                                f"characters, over the limit of {limits.max_min_length} "
                                                "(--structured-outputs-max-min-length)")


def _json(schema: str, options: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _json_object(_value, options: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)


def _regex(pattern: str, _options) -> str:
    return llguidance.LLMatcher.grammar_from_lark(f"start: /{ascii_regex(pattern)}/")


def _choice(choices: list[str], _options) -> str:
    # One terminal, not one rule alternative per string: its lexer is built in linear time, while the parser's
    # cost grows faster than the number of alternatives (50k strings: 0.9 s against 10 s). JSON string
    # literals are valid Lark string literals, escapes included.
    return llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, choices)))


def _grammar_to_lark(text: str) -> str:
    # "grammar" accepts Lark, or GBNF (rules written with ::=), which it converts to Lark.
    try:
        lark = any_to_lark(text)
    except RecursionError:
        raise ValueError("the grammar is nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - the converter raises its own error types
        raise ValueError(f"cannot convert the grammar from GBNF to Lark: {e}") from None
    return ascii_lark_regexes(lark)


def ascii_regex(pattern: str) -> str:
    r"""`pattern` with ASCII `\d \w \s \D \W \S` (inside character classes too), ready to go between the
    slashes of a Lark terminal. llguidance's own converter does it: it knows escapes (`\\d` stays) and classes
    (`[^\d.]` becomes `[^[0-9].]`, a nested class in Rust syntax)."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:  # the converter would drop it
        raise ValueError("the regex ends with an unfinished escape (a lone backslash)")
    return llguidance.regex_to_lark(pattern, "dws")


# The lexemes of llguidance's Lark syntax that may hold a "/" without being a regex, then the regex terminal
# /.../ (its flags follow it): strings (JSON syntax; %json bodies are JSON, so their strings too), comments
# (# or //) and special tokens <...>. Nothing else in the syntax holds a '"', '#', '<' or '/'.
_LARK_LEXEME = re.compile(r'"(?:\\.|[^"\\])*"|(?:#|//)[^\n]*|<[^<>\s]+>|/((?:\\.|[^/\\])+)/')


def ascii_lark_regexes(lark: str) -> str:
    r"""A Lark grammar with its regex terminals' `\d \w \s` (and complements) made ASCII."""
    def fix(m: re.Match) -> str:
        return m.group(0) if m.group(1) is None else f"/{ascii_regex(m.group(1))}/"

    return _LARK_LEXEME.sub(fix, lark)


_BUILDERS = {"json": _json, "json_object": _json_object, "regex": _regex, "choice": _choice}
