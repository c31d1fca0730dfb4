"""What a constrained request's output must match: vLLM's `StructuredOutputsParams` fields.

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. A msgspec Struct, so it travels
inside `SamplingParams` to the engine process unchanged. The engine turns it into a grammar
(`engine.structured.grammar`); this file only checks its shape.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

import msgspec

from vlserve.core.errors import ConfigurationError, InvalidInputError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar bigger than this is refused before anything compiles it


class StructuredOutputsError(InvalidInputError):
    """A constraint of `kind` that is wrong (`problem`: "cannot be compiled: ...", ...). The message names the
    request field it came in, by default vLLM's `structured_outputs.<kind>`; the server names the field the
    client actually sent (`response_format.json_schema.schema`, `guided_json`, ...) with `for_field`."""

    def __init__(self, kind: str, problem: str, field: str | None = None):
        self.kind, self.problem = kind, problem
        self.field = field or f"structured_outputs.{kind}"
        super().__init__(f"{self.field} {problem}")

    def for_field(self, field: str) -> StructuredOutputsError:
        return StructuredOutputsError(self.kind, self.problem, field)

    def __reduce__(self):
        return type(self), (self.kind, self.problem, self.field)


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: str | dict[str, Any] | None = None  # a JSON schema; kept as canonical text after validation
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's syntax) or GBNF (`::=` rules, as xgrammar / llama.cpp)
    json_object: bool | None = None  # any JSON object
    # JSON only. vLLM's name; here the default is True: compact JSON, so a weak model cannot ramble in whitespace.
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # Kept in its key order: properties are generated in the order the schema lists them.
            self.json = jsonlib.dumps(self.json, separators=(",", ":"), ensure_ascii=False)
        if self.json_object is False:
            self.json_object = None
        chosen = [k for k in KINDS if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise InvalidInputError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                                    f"{', '.join(chosen) or 'none'}")
        kind = chosen[0]
        value = getattr(self, kind)
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise StructuredOutputsError(kind, "must be a non-empty list of non-empty strings")
            if sum(map(len, value)) > MAX_SPEC_CHARS:  # the same bound as one schema or grammar
                raise StructuredOutputsError(kind, f"is longer than {MAX_SPEC_CHARS} characters in all")
        elif kind != "json_object":
            if not isinstance(value, str) or not value.strip():
                raise StructuredOutputsError(kind, "must be a non-empty string")
            if len(value) > MAX_SPEC_CHARS:
                raise StructuredOutputsError(kind, f"is longer than {MAX_SPEC_CHARS} characters")
        if kind == "json":
            try:
                schema = jsonlib.loads(value)
            except (ValueError, RecursionError) as e:
                raise StructuredOutputsError(kind, f"is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputsError(kind, "must be a JSON schema (an object)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: requests with equal keys share one."""
        value = self.choice if self.kind == "choice" else getattr(self, self.kind)
        return (self.kind, tuple(value) if isinstance(value, list) else value, self.disable_any_whitespace)


@dataclass(frozen=True)
class GrammarLimits:
    """What compiling one constraint may cost (the `structured_outputs_*` engine options): checked on the spec
    before anything compiles it, then by the grammar engine's own limits, then against the clock."""

    max_rules: int = 4096
    max_choices: int = 16384
    max_min_length: int = 16384
    compile_timeout: float = 10.0
    threads: int = 2
    max_queued: int = 16
    cache_mb: int = 512

    @classmethod
    def from_args(cls, args: Any) -> GrammarLimits:
        """From EngineArgs' `structured_outputs_<name>` fields (None: the defaults)."""
        if args is None:
            return cls()
        limits = cls(**{name: getattr(args, f"structured_outputs_{name}") for name in cls.__dataclass_fields__})
        for name in cls.__dataclass_fields__:
            value = getattr(limits, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or value < 0 or (value == 0 and name != "max_queued"):  # no queue at all is fine
                raise ConfigurationError(f"structured_outputs_{name} must be a positive number, got {value!r}")
        return limits


def structured_outputs_from(value: Any) -> StructuredOutputsParams | None:
    """A `StructuredOutputsParams`, or the same given as a dict (the HTTP field, or offline users' dicts)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise InvalidInputError("structured_outputs must be an object with one of " + ", ".join(KINDS))
    unknown = set(value) - set(StructuredOutputsParams.__struct_fields__)
    if unknown:
        raise InvalidInputError(f"structured_outputs: unsupported field(s) {sorted(unknown)}; "
                                f"supported: {', '.join(StructuredOutputsParams.__struct_fields__)}")
    try:
        return msgspec.convert(value, StructuredOutputsParams)
    except msgspec.ValidationError as e:
        if isinstance(e.__cause__, StructuredOutputsError):  # msgspec wraps what __post_init__ raised
            raise e.__cause__ from None
        raise InvalidInputError(f"structured_outputs: {e}") from None
