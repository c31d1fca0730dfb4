"""Every role's CLI lists exactly the flags that role honours, each with help and its default; child command
lines built from options round-trip through the parsers."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from vlserve.cli import build_parser
from vlserve.core.config import BOOTSTRAP, DECODE, DEMO, ENCODE, LANGUAGE, PREFILL, ROLES, SERVE
from vlserve.core.options import options_from, role_fields, to_argv


def _subparser(role: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[role]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


@pytest.mark.parametrize("role", ROLES)
def test_every_flag_has_help_and_shows_its_default(role):
    parser = _subparser(role)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{role} {action.option_strings} has no help"
    for _, _, f in role_fields(role):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default not in (None, False, True, (), {}) and not f.metadata.get("secret"):  # switches need none
            action = next(a for a in parser._actions if a.dest == f.name)
            assert "default:" in action.help, f"{role} --{f.name} hides its default"


EXPECTED = {  # flags a role must list, and flags it must not (it would silently ignore them)
    ENCODE: ({"--max-image-pixels", "--allowed-local-media-path", "--max-media-bytes", "--data-port",
              "--transfer-timeout", "--encoder-cache-size", "--disagg-secret", "--tensor-parallel-size",
              "--mm-encoder-tp-mode"},
             {"--max-model-len", "--api-key", "--max-num-seqs", "--num-kv-blocks", "--served-model-name",
              "--enable-mm-embeds", "--max-n", "--peer-wait-timeout", "--media-buffer-blocks",
              "--kv-buffer-blocks"}),
    LANGUAGE: ({"--max-model-len", "--api-key", "--bootstrap", "--transfer-timeout", "--enable-mm-embeds",
                "--disagg-secret", "--max-request-bytes", "--tensor-parallel-size", "--peer-wait-timeout"},
               {"--allowed-local-media-path", "--max-image-pixels", "--encoder-cache-size", "--data-port",
                "--disagg", "--num-encoders", "--mm-encoder-tp-mode"}),
    PREFILL: ({"--max-model-len", "--bootstrap", "--data-port", "--transfer-timeout", "--transfer-failure-prob",
               "--disagg-secret", "--media-buffer-blocks", "--num-kv-blocks", "--transfer-backend",
               "--peer-wait-timeout", "--embedding-buffer-blocks", "--tensor-parallel-size", "--enable-lora",
               "--lora-modules"},
              {"--api-key", "--served-model-name", "--allowed-local-media-path", "--max-image-pixels",
               "--encoder-cache-size", "--disagg", "--max-n", "--chat-template", "--enable-mm-embeds",
               "--kv-buffer-blocks", "--mm-encoder-tp-mode", "--allow-runtime-lora", "--lora-dir"}),
    DECODE: ({"--max-model-len", "--api-key", "--bootstrap", "--transfer-timeout", "--chat-template", "--max-n",
              "--kv-buffer-blocks", "--kv-allocate-tokens", "--enable-mm-embeds", "--transfer-backend",
              "--peer-wait-timeout", "--tensor-parallel-size", "--enable-lora", "--lora-modules"},
             {"--allowed-local-media-path", "--max-image-pixels", "--encoder-cache-size", "--data-port", "--disagg",
              "--transfer-failure-prob", "--num-prefill", "--media-buffer-blocks", "--embedding-buffer-blocks",
              "--mm-encoder-tp-mode"}),
    BOOTSTRAP: ({"--host", "--port", "--heartbeat-interval", "--heartbeat-failure-threshold", "--disagg-secret"},
                {"--model", "--api-key", "--max-model-len"}),
    SERVE: ({"--model", "--api-key", "--max-image-pixels", "--disagg", "--num-encoders", "--transfer-timeout",
             "--max-model-len", "--num-prefill", "--num-decode", "--tensor-parallel-size", "--mm-encoder-tp-mode",
             "--peer-wait-timeout"},
            {"--bootstrap", "--data-port"}),
    DEMO: ({"--model", "--dtype", "--prompt", "--tensor-parallel-size", "--mm-encoder-tp-mode"},
           {"--api-key", "--port", "--max-image-pixels"}),
}


@pytest.mark.parametrize("role", list(EXPECTED))
def test_each_role_lists_only_what_it_honours(role):
    flags = _flags(_subparser(role))
    must, must_not = EXPECTED[role]
    assert must <= flags, must - flags
    assert not (must_not & flags), must_not & flags


def test_role_defaults_and_env(monkeypatch):
    enc = options_from(_subparser(ENCODE).parse_args(["--model", "m"]), ENCODE)
    assert enc.server.port == 8100
    boot = options_from(_subparser(BOOTSTRAP).parse_args([]), BOOTSTRAP)
    assert boot.server.port == 8998
    assert options_from(_subparser(PREFILL).parse_args(["--model", "m"]), PREFILL).server.port == 8200
    decode = options_from(_subparser(DECODE).parse_args(["--model", "m"]), DECODE)
    assert (decode.server.port, decode.disagg.kv_buffer_blocks) == (8000, 1024)
    monkeypatch.setenv("VLSERVE_API_KEY", "k")
    assert options_from(_subparser(SERVE).parse_args([]), SERVE).server.api_key == "k"


def test_child_command_lines_round_trip():
    """What `serve --disagg` writes for a child parses back to the same options for that child's role."""
    parsed = _subparser(SERVE).parse_args([
        "--model", "/m", "--dtype", "float32", "--max-model-len", "2048", "--limit-mm-per-prompt", "image=3,video=0",
        "--allowed-media-domains", "a.com", "b.org", "--max-image-pixels", "1000", "--api-key", "secret-key",
        "--transfer-timeout", "7", "--disable-prefix-caching", "--enable-mm-embeds", "--kv-buffer-blocks", "64",
        "--embedding-buffer-blocks", "128"])
    opts = options_from(parsed, SERVE)
    assert (opts.disagg.kv_buffer_blocks, opts.disagg.media_buffer_blocks) == (64, 128)  # an old name still works
    opts.disagg.disagg_secret = "s3cret"
    for role in (LANGUAGE, ENCODE, PREFILL, DECODE, BOOTSTRAP):
        argv, env = to_argv(opts, role)
        assert "secret-key" not in argv and "s3cret" not in argv  # secrets travel in the environment only
        back = options_from(_subparser(role).parse_args(argv), role)
        for _, cls, f in role_fields(role):
            want, got = getattr(opts.parts()[cls], f.name), getattr(back.parts()[cls], f.name)
            if f.metadata.get("secret"):
                assert env.get(f.metadata["env"]) == (None if want is None else str(want)), f.name
            elif f.name != "port":  # each role has its own default port
                assert got == want, (role, f.name, got, want)
