"""CLI flags generated from the option definitions in `core.config`, per role; and the way back (a role's
command line from an `Options`), which `serve --disagg` uses to start its children."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from vlserve.core.config import (
    DERIVED_ROLES,
    OPTION_GROUPS,
    DisaggArgs,
    EngineArgs,
    Options,
    ServerArgs,
)
from vlserve.core.errors import ConfigurationError

_SCALARS = {"int": int, "float": float, "str": str}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _base(role: str) -> str:
    """The role whose defaults a derived role takes (itself for any other)."""
    return DERIVED_ROLES[role][0][0] if role in DERIVED_ROLES else role


def _default(f: dataclasses.Field, role: str):
    role = _base(role)
    if role in f.metadata.get("role_defaults", {}):
        return f.metadata["role_defaults"][role]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _scalar_type(f: dataclasses.Field):
    """int / float / str from the annotation ("int | None" -> int)."""
    name = str(f.type).split(" | ")[0].split("[")[0]
    return _SCALARS.get(name, str)


def _is_bool(f: dataclasses.Field) -> bool:
    return str(f.type) == "bool"


def role_fields(role: str):
    """(group title, dataclass, field) for every option `role` honours (a derived role: its base's, less some)."""
    bases, left_out = DERIVED_ROLES.get(role, ((role,), frozenset()))
    for title, cls in OPTION_GROUPS:
        for f in dataclasses.fields(cls):
            if any(b in f.metadata.get("roles", ()) for b in bases) and f.name not in left_out:
                yield title, cls, f


def _help(f: dataclasses.Field, role: str) -> str:
    text, default = f.metadata.get("help", ""), _default(f, role)
    if f.metadata.get("secret"):
        return text + (f" (or env {f.metadata['env']})" if f.metadata.get("env") else "")
    if _is_bool(f) or default is None or default == () or default == {}:
        return text
    if isinstance(default, dict):
        default = ",".join(f"{k}={v}" for k, v in default.items())
    return f"{text} (default: {default})"


def add_options(parser: argparse.ArgumentParser, role: str, model_required: bool = False) -> None:
    """Registers exactly the flags `role` honours, grouped like the option dataclasses."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for title, _, f in role_fields(role):
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        flag, help_text = _flag(f), _help(f, role)
        # Flags default to None ("not given"), so the dataclass default stays the single source of truth.
        if _is_bool(f):
            action = "store_false" if f.metadata.get("negate") else "store_true"
            group.add_argument(flag, *f.metadata.get("aliases", ()), dest=f.name, action=action, default=None,
                               help=help_text)
            continue
        kwargs = {"dest": f.name, "default": None, "help": help_text, "metavar": _metavar(f)}
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if f.metadata.get("nargs"):
            kwargs["nargs"] = f.metadata["nargs"]
        kwargs["type"] = _arg_parser(f)
        if f.name == "model":
            kwargs["required"] = model_required
        group.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)


def _metavar(f: dataclasses.Field) -> str | None:
    if f.metadata.get("choices"):
        return None  # argparse lists them
    return f.metadata.get("metavar") or {int: "N", float: "X"}.get(_scalar_type(f), f.name.split("_")[-1].upper())


def _arg_parser(f: dataclasses.Field):
    parse = f.metadata.get("parse") or _scalar_type(f)

    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse names it in "invalid <name> value"
    return convert


def options_from(ns: argparse.Namespace, role: str) -> Options:
    """The role's options: flags the user gave, then environment variables, then the dataclass defaults."""
    values: dict[type, dict] = {cls: {} for _, cls in OPTION_GROUPS}
    for _, cls, f in role_fields(role):
        value = getattr(ns, f.name, None)
        if value is None and f.metadata.get("env"):
            value = os.environ.get(f.metadata["env"]) or None
            if value is not None:
                value = _arg_parser(f)(value)
        if value is None and _base(role) in f.metadata.get("role_defaults", {}):
            value = f.metadata["role_defaults"][_base(role)]
        if value is not None:
            check_range(f, value)
            values[cls][f.name] = tuple(value) if isinstance(value, list) else value
    return Options(EngineArgs(**values[EngineArgs]), ServerArgs(**values[ServerArgs]), DisaggArgs(**values[DisaggArgs]))


def check_range(f: dataclasses.Field, value) -> None:
    """A numeric option's value is finite and within its bounds (default >= 0); else ConfigurationError naming
    the flag (the process exits 78 before loading anything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    lo, hi = f.metadata.get("bounds") or (0, None)
    if math.isfinite(value) and (lo is None or value >= lo) and (hi is None or value <= hi):
        return
    wanted = ("a finite number" if lo is None and hi is None else f"between {lo} and {hi}" if hi is not None
              else f"at least {lo}")
    raise ConfigurationError(f"{_flag(f)} must be {wanted}, got {value}")


def to_argv(opts: Options, role: str) -> tuple[list[str], dict[str, str]]:
    """The command line (and environment, for secrets) that gives `role` these options.

    Only options that role honours and that differ from their defaults are written out.
    """
    argv: list[str] = []
    env: dict[str, str] = {}
    parts = opts.parts()
    for _, cls, f in role_fields(role):
        value = getattr(parts[cls], f.name)
        if value == _default(f, role) or value is None:
            continue
        if f.metadata.get("secret"):
            if f.metadata.get("env"):
                env[f.metadata["env"]] = str(value)
            continue
        if _is_bool(f):
            argv.append(_flag(f))
        elif isinstance(value, dict):
            argv += [_flag(f), ",".join(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, (list, tuple)):
            argv += [_flag(f), *map(str, value)]
        else:
            argv += [_flag(f), str(value)]
    return argv, env

