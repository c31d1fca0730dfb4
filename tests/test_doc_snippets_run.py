"""Runs every runnable code block of README.md and docs/*.md, as written, against the demo model served by
`vlserve serve` without --model (tests/doc_snippets.py has the convention and the driver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_snippets import ROOT, blocks_of, documents
from tests.server_utils import RemoteServer, free_port

RUNNABLE = [doc for doc in documents() if any(b.runs for b in blocks_of(doc))]


@pytest.fixture(scope="module")
def demo_server():
    with RemoteServer(None) as server:
        yield server


@pytest.mark.parametrize("doc", RUNNABLE, ids=[str(d.relative_to(ROOT)) for d in RUNNABLE])
def test_documented_blocks_run(doc, demo_server, tmp_path):
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # `.venv/bin/vlserve` as the docs write it
    ports = {"8000": demo_server.port, **{str(p): free_port() for p in range(8001, 8010)}}
    env = {k: v for k, v in os.environ.items() if k not in ("VLSERVE_API_KEY", "OPENAI_API_KEY")}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "doc_snippets.py"), str(doc), json.dumps(ports)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{out.stdout[-12000:]}\n{out.stderr[-4000:]}\nserver log:\n" + \
        demo_server.read_log()[-3000:]
