"""The code blocks of README.md and docs/*.md, and a driver that runs one document's blocks as a reader would.

Convention (checked by tests/test_doc_snippets.py):
- a ```bash or ```python block is run, in document order, against the demo server (`vlserve serve` without
  --model: the random demo checkpoint served as `vlserve-demo`);
- a block that cannot run in a test (a real model, a GPU, several machines, docker, kubectl, minutes of work)
  has `<!-- not run: REASON -->` on the line before its opening fence; its `vlserve` command lines are still
  parsed with the real CLI parser;
- any other block says what it is (```text, ```yaml, ```json, ...); a fence with no language is refused.

Run as `python tests/doc_snippets.py DOC PORTS_JSON` from a scratch folder: bash blocks run with
`bash -e -o pipefail` (each in a process group of its own, killed when the document is done, so a server a
block starts in the background serves the blocks after it), python blocks are exec'd in one namespace per
document. Ports 8000-8009 in the code (`HOST:800N`, `--port 800N`) are rewritten by PORTS_JSON ({"8000": real port, ...}).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGUAGES = ("bash", "python")
OTHER_LANGUAGES = ("text", "yaml", "json", "console", "dockerfile", "ini", "toml", "html", "jinja", "lark",
                   "ebnf", "diff", "promql")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<why>.*?)-->\s*$")
PORT = re.compile(r"(?:(?<=:)|(?<=--port )|(?<=--port=))(800\d)(?!\d)")  # an address's or --port's 8000-8009
ERROR_BODY = re.compile(r'"error"\s*:\s*\{|"object"\s*:\s*"error"')
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    language: str  # the info string's first word, lower case ("" when none)
    code: str  # the block's lines, the fence's indentation removed
    not_run: str | None  # the reason given in <!-- not run: ... -->, None when it runs

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES and self.not_run is None


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence[0]) and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            body.append(lines[j][indent:] if not indent or lines[j][:indent].isspace() else lines[j].lstrip())
            j += 1
        previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.match(previous)
        info = opening["info"].strip().split()
        found.append(Block(doc, i + 1, info[0].lower() if info else "", "\n".join(body) + "\n",
                           marker["why"].strip() if marker else None))
        i = j + 1
    return found


def vlserve_commands(code: str) -> list[list[str]]:
    """Each `vlserve ...` command of a shell block as argv after the program: continuation lines joined, comments,
    `&` and what follows a `|`, `&&` or `;` dropped, `<placeholders>` kept as one word."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        line = re.sub(r"<[^<>]*>", "PLACEHOLDER", line)
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for k, word in enumerate(words):
            if word.endswith("bin/vlserve") or word == "vlserve" and (k == 0 or words[k - 1] == "-m"):
                argv = []
                for rest in words[k + 1:]:
                    if rest in ("&", "|", "&&", "||", ";") or rest.endswith(";"):
                        break
                    argv.append(rest)
                commands.append(argv)
                break
    return commands


def with_ports(code: str, ports: dict[str, int]) -> str:
    return PORT.sub(lambda m: str(ports.get(m[1], m[1])), code)


def run_document(doc: Path, ports: dict[str, int]) -> int:
    """Runs the document's runnable blocks in order in this folder; returns non-zero at the first failure."""
    namespace: dict = {"__name__": "__main__"}
    groups: list[int] = []
    try:
        for n, block in enumerate(b for b in blocks_of(doc) if b.runs):
            code = with_ports(block.code, ports)
            print(f"--- {block.where} ({block.language})", flush=True)
            started = time.monotonic()
            if block.language == "bash":
                log = Path(f"block-{n}.log")
                with log.open("w") as out:  # a file, not a pipe: a server left in the background must not hold it
                    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                    groups.append(proc.pid)
                    try:
                        code_ = proc.wait(BLOCK_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        code_ = f"timeout after {BLOCK_TIMEOUT_S} s"
                text = log.read_text()
                print(text[-4000:], flush=True)
                if code_ != 0:
                    print(f"FAILED {block.where}: exit {code_}", flush=True)
                    return 1
                if ERROR_BODY.search(text):
                    print(f"FAILED {block.where}: the output holds an error answer", flush=True)
                    return 1
            else:
                try:
                    exec(compile(code, block.where, "exec"), namespace)
                except BaseException:  # noqa: BLE001 - a snippet's failure of any kind is the report
                    traceback.print_exc()
                    print(f"FAILED {block.where}", flush=True)
                    return 1
                sys.stdout.flush()
            print(f"--- ok in {time.monotonic() - started:.1f} s", flush=True)
        return 0
    finally:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15  # a server stops its engine on SIGTERM; give it the time to
        while groups and time.monotonic() < deadline and any(_alive(g) for g in groups):
            time.sleep(0.2)
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


if __name__ == "__main__":
    sys.exit(run_document(Path(sys.argv[1]), {k: int(v) for k, v in json.loads(sys.argv[2]).items()}))
