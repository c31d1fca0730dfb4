"""Every code block of README.md and docs/*.md says what it is, and every `vlserve` command in them parses with
the real CLI (tests/doc_snippets.py has the convention; tests/test_doc_snippets_run.py runs the blocks)."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.doc_snippets import (OTHER_LANGUAGES, RUN_LANGUAGES, Block, blocks_of, documents, vlserve_commands,
                                 with_ports)
from vlserve.cli import build_parser

BLOCKS = [block for doc in documents() for block in blocks_of(doc)]


def test_every_block_is_run_or_says_why_not():
    problems = []
    for block in BLOCKS:
        if block.language not in RUN_LANGUAGES + OTHER_LANGUAGES:
            problems.append(f"{block.where}: fence language {block.language or '(none)'!r}: name one of "
                            f"{RUN_LANGUAGES + OTHER_LANGUAGES}")
        if block.not_run is not None and not block.not_run:
            problems.append(f"{block.where}: <!-- not run: --> without a reason")
        if block.not_run is not None and block.language not in RUN_LANGUAGES:
            problems.append(f"{block.where}: a ```{block.language} block is never run; drop its not-run marker")
    assert not problems, "\n".join(problems)
    assert sum(b.runs for b in BLOCKS if b.doc.name == "README.md") >= 3, "the README's examples must run"


def test_the_parser_finds_blocks_and_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n```bash\necho one\n```\n\n<!-- not run: needs a GPU -->\n\n```python\nimport torch\n```\n"
                   "- a list item:\n  ```bash\n  .venv/bin/vlserve serve \\\n      --port 8001 &   # note\n  ```\n"
                   "````text\n```\n````\n")
    found = blocks_of(doc)
    assert [(b.language, b.not_run, b.line) for b in found] == [
        ("bash", None, 2), ("python", "needs a GPU", 8), ("bash", None, 12), ("text", None, 16)]
    assert found[2].code == ".venv/bin/vlserve serve \\\n    --port 8001 &   # note\n"
    assert found[3].code == "```\n"
    assert vlserve_commands(found[2].code) == [["serve", "--port", "8001"]]


def test_command_lines_are_read_as_a_shell_would():
    code = ("export X=1\nvlserve encode --host <this machine's address> --port 8100  # E1\n"
            "torchrun --nnodes 2 -m vlserve serve --model /m --host 0.0.0.0\n"
            ".venv/bin/vlserve router --replica http://a:8000 | tee log; echo done\n"
            "echo vlserve is not a command here\n")
    assert vlserve_commands(code) == [["encode", "--host", "PLACEHOLDER", "--port", "8100"],
                                      ["serve", "--model", "/m", "--host", "0.0.0.0"],
                                      ["router", "--replica", "http://a:8000"]]


def _commands() -> list[tuple[Block, list[str]]]:
    return [(block, argv) for block in BLOCKS if block.language == "bash" for argv in vlserve_commands(block.code)]


@pytest.mark.parametrize("where,argv", [(b.where, argv) for b, argv in _commands()],
                         ids=[f"{b.where}-{' '.join(argv[:1])}" for b, argv in _commands()])
def test_every_documented_command_parses(where, argv):
    """Run blocks included: a flag renamed later must fail here, not in a reader's terminal."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, f"{where}: `vlserve {' '.join(argv)}` does not parse: {errors.getvalue()[-600:]}"


def test_only_addresses_and_port_flags_are_rewritten():
    code = "curl 127.0.0.1:8000/v1 localhost:8001 --port 8001 --port=8002\nx = 8000 * sin(t)  # 8001 samples\n"
    assert with_ports(code, {"8000": 41000, "8001": 41001, "8002": 41002}) == \
        "curl 127.0.0.1:41000/v1 localhost:41001 --port 41001 --port=41002\nx = 8000 * sin(t)  # 8001 samples\n"
