r"""A `StructuredOutputsParams` -> an llguidance grammar, checked, cached by the spec's key.

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

import functools
import json
import re

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from vlserve.core.structured_outputs import StructuredOutputsError, StructuredOutputsParams

# JSON without free whitespace: "," and ":" exactly, so a model cannot spend its tokens on spaces.
COMPACT_JSON = {"whitespace_flexible": False}
FLEXIBLE_JSON = {"whitespace_flexible": True}


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec`; StructuredOutputsError (400) with llguidance's reason if it cannot
    compile."""
    return _compile(spec.key)


@functools.lru_cache(maxsize=512)
def _compile(key: tuple) -> str:
    kind, value, compact = key
    json_options = COMPACT_JSON if compact else FLEXIBLE_JSON
    try:
        grammar = _BUILDERS[kind](value, json_options)
    except ValueError as e:  # not JSON, or a GBNF grammar the converter cannot read
        raise StructuredOutputsError(kind, f"cannot be compiled: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputsError(kind, f"cannot be compiled: {error.strip()[:2000]}")
    return grammar


def _json(schema: str, options: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _json_object(_value, options: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)


def _regex(pattern: str, _options) -> str:
    return llguidance.LLMatcher.grammar_from_lark(f"start: /{ascii_regex(pattern)}/")


def _choice(choices: tuple[str, ...], _options) -> str:
    # JSON string literals are valid Lark string literals, escapes included.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _grammar(text: str, _options) -> str:
    # "grammar" accepts Lark, or GBNF (rules written with ::=), which it converts to Lark.
    try:
        lark = any_to_lark(text)
    except Exception as e:  # noqa: BLE001 - the converter raises its own error types
        raise ValueError(f"cannot convert the grammar from GBNF to Lark: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(ascii_lark_regexes(lark))


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


_BUILDERS = {"json": _json, "json_object": _json_object, "regex": _regex, "choice": _choice, "grammar": _grammar}
