"""What `vlserve --help` says about the model families comes from the registries, so it cannot drift."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from vlserve.cli import build_parser
from vlserve.core.errors import EXIT_CONFIG
from vlserve.tools.tiny_arches import TINY_ARCHES


def _text(capsys, *argv: str) -> str:
    """`vlserve [argv] --help`, on one line (argparse wraps lines where it likes)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return re.sub(r"\s+", " ", capsys.readouterr().out)


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_top_level_help_names_every_family_make_tiny_model_writes(capsys):
    text = _text(capsys)
    families = ", ".join(a.family for a in TINY_ARCHES.values())
    assert f"Serve vision-language models ({families}) with an OpenAI-compatible API." in text
    assert "Qwen2-VL family" not in text
    line = text[text.index("make-tiny-model"):]
    line = line[:line.index("offline)")]  # the summary's list of families
    for arch in TINY_ARCHES.values():
        assert arch.family in line, f"make-tiny-model's summary leaves out {arch.family}"


def test_make_tiny_model_help_lists_every_arch_it_accepts(capsys):
    text = _text(capsys, "make-tiny-model")
    for name, arch in TINY_ARCHES.items():
        assert f"{name} ({arch.family})" in text
    accepted = next(a for a in _subcommand("make-tiny-model")._actions if a.dest == "arch").choices
    assert tuple(accepted) == tuple(TINY_ARCHES)


def test_make_tiny_model_and_the_served_models_are_the_same_families():
    # Every family make-tiny-model writes is one vlserve serves, and every served one has a tiny checkpoint.
    from vlserve.model.families import supported_architectures
    from vlserve.tools.tiny_model import ARCHES

    assert {a.model_class for a in TINY_ARCHES.values()} == set(supported_architectures())
    assert {name: (c.__name__, m.__name__) for name, (c, m) in ARCHES.items()} == {
        name: (a.config_class, a.model_class) for name, a in TINY_ARCHES.items()}


def test_help_from_a_fresh_process_imports_no_torch():
    code = ("import sys; from vlserve.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("command", ["serve", "language"])
def test_a_bad_chat_template_flag_is_reported_before_torch_is_imported(command, tmp_path):
    """A typo in --chat-template costs no model load (nor the 5 s of imports before one)."""
    code = ("import sys; from vlserve.cli import main; "
            f"code = main([{command!r}, '--model', {str(tmp_path)!r}, '--port', '0', "
            "'--chat-template', '/no/such/template.jinja']); "
            "print(code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "is neither a file nor a Jinja template" in out.stderr, out.stderr
    assert out.stdout.split() == [str(EXIT_CONFIG), "False"], out.stdout + out.stderr


@pytest.mark.parametrize("argv", [
    ["serve", "--peer-wait-timeout", "nan"], ["serve", "--peer-wait-timeout", "inf"],
    ["serve", "--peer-wait-timeout", "-1"], ["serve", "--peer-wait-timeout", "1e12"],
    ["serve", "--max-num-seqs", "0"], ["serve", "--port", "70000"], ["router", "--routing-cache-weight", "nan"],
    ["serve", "--heartbeat-interval", "0"], ["encode", "--transfer-failure-prob", "1.5"],
])
def test_every_numeric_flag_out_of_range_stops_the_start_naming_the_flag(argv):
    """Checked before anything loads: exit 78 (EX_CONFIG) and the flag's name (nan once made a request wait 40 s
    instead of a 503)."""
    import logging

    from vlserve.cli import main
    from vlserve.core.errors import EXIT_CONFIG

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vlserve").addHandler(handler)
    try:
        assert main([argv[0], "--model", "/no/such/model", *argv[1:]]) == EXIT_CONFIG
    finally:
        logging.getLogger("vlserve").removeHandler(handler)
    assert any(argv[1] in r.getMessage() for r in records), [r.getMessage() for r in records]


def test_every_numeric_option_has_a_range():
    """Defaults are in range, and every float is checked for finiteness (bounds or the >= 0 default)."""
    import dataclasses

    from vlserve.core.config import OPTION_GROUPS
    from vlserve.core.options import check_range

    for _, cls in OPTION_GROUPS:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            check_range(f, default)
