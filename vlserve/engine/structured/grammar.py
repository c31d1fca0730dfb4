"""A `StructuredOutputsParams` -> an llguidance grammar, checked, cached by the spec's key.

llguidance (not xgrammar): one dependency-free wheel (xgrammar pulls triton and a TVM runtime), grammars are
built lazily so even big schemas need no ahead-of-time compile, it reads both Lark and GBNF grammars, and
its matchers roll back and fill batch masks on their own threads without the GIL.
"""

from __future__ import annotations

import functools
import json

import llguidance

from vlserve.core.errors import InvalidInputError
from vlserve.core.structured_outputs import StructuredOutputsParams

# JSON without free whitespace: "," and ":" exactly, so a model cannot spend its tokens on spaces.
COMPACT_JSON = {"whitespace_flexible": False}
FLEXIBLE_JSON = {"whitespace_flexible": True}


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec`; InvalidInputError (400) with llguidance's reason if it cannot compile."""
    return _compile(spec.key)


@functools.lru_cache(maxsize=512)
def _compile(key: tuple) -> str:
    kind, value, compact = key
    json_options = COMPACT_JSON if compact else FLEXIBLE_JSON
    try:
        grammar = _BUILDERS[kind](value, json_options)
    except ValueError as e:  # not JSON, or a GBNF grammar the converter cannot read
        raise InvalidInputError(f"structured_outputs.{kind} cannot be compiled: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidInputError(f"structured_outputs.{kind} cannot be compiled: {error.strip()[:2000]}")
    return grammar


def _json(schema: str, options: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _json_object(_value, options: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)


def _regex(pattern: str, _options) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def _choice(choices: tuple[str, ...], _options) -> str:
    # JSON string literals are valid Lark string literals, escapes included.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _grammar(text: str, _options) -> str:
    # "grammar" accepts Lark, or GBNF (rules written with ::=), which it converts to Lark.
    return llguidance.grammar_from("grammar", text)


_BUILDERS = {"json": _json, "json_object": _json_object, "regex": _regex, "choice": _choice, "grammar": _grammar}
