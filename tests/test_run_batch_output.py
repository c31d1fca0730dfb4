"""`vlserve run-batch`'s output, in this process (no engine): lines are written by one writer thread, whole and in
the order they were handed over, never on the event loop; a write that fails (a full disk) ends the run with one
line of error and the summary; the output is locked against a second run and must be a file (or a character
device such as /dev/null), never a FIFO that would block the run forever."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import types

import httpx
import pytest

from vlserve.core.errors import ConfigurationError
from vlserve.server.batch_files import Done, InputLines
from vlserve.server.run_batch import BatchOutput, Runner, Tally, answer_lines, conclude, open_output

GATE_WAIT_S = 30  # bounds a failure only: a write held on the event loop never sees its gate opened


def batch_input(n: int) -> bytes:
    line = {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}
    return b"".join(json.dumps({**line, "custom_id": f"id-{i}"}).encode() + b"\n" for i in range(n))


class Client:
    """The app's stand-in: answers each line at once, with its custom_id echoed."""

    async def post(self, url, content, headers):
        await asyncio.sleep(0)
        return httpx.Response(200, json={"id": "x", "echo": json.loads(content)["messages"][0]["content"]})


def run_lines(output, n: int, max_concurrency: int = 4, during=None) -> Tally:
    """`n` lines through answer_lines into `output`; `during`: a coroutine run on the loop meanwhile."""
    tally = Tally()

    async def main():
        engine = types.SimpleNamespace(dead=asyncio.Event())
        runner = Runner(Client(), output, tally, types.SimpleNamespace(update=lambda: None), engine.dead)
        helper = asyncio.ensure_future(during()) if during else None
        await answer_lines(InputLines(io.BytesIO(batch_input(n)), 1 << 20), Done(), runner, engine, max_concurrency)
        if helper:
            await helper

    asyncio.run(main())
    return tally


class Stream:
    """A raw output: takes at most `chunk` bytes a write (as a pipe may), and can be held or fail."""

    def __init__(self, chunk: int = 1 << 20, fail_after: int | None = None, gate: threading.Event | None = None):
        self.data, self.chunk, self.fail_after, self.gate = bytearray(), chunk, fail_after, gate
        self.started, self.released, self.writes = threading.Event(), [], 0

    def write(self, data) -> int:
        self.writes += 1
        if self.gate is not None:
            self.started.set()
            self.released.append(self.gate.wait(GATE_WAIT_S))
        if self.fail_after is not None and len(self.data) >= self.fail_after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.data += bytes(data[:self.chunk])
        return min(len(data), self.chunk)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_held_write_does_not_hold_the_event_loop():
    """A slow stdout held every line in flight: the writes ran (and flushed) on the event loop."""
    gate = threading.Event()
    stream = Stream(gate=gate)

    async def open_gate_once_a_write_waits():
        while not stream.started.is_set():  # only runs while the loop is free
            await asyncio.sleep(0.01)
        gate.set()

    output = BatchOutput(stream, "slow")
    tally = run_lines(output, 3, during=open_gate_once_a_write_waits)
    output.close()
    assert stream.released and all(stream.released) and tally.answered == 3


def test_lines_are_written_whole_and_in_the_order_handed_over():
    stream = Stream(chunk=7)  # a pipe that takes a few bytes at a time
    output = BatchOutput(stream, "pipe")
    tally = run_lines(output, 40)
    output.close()
    records = [json.loads(line) for line in stream.data.splitlines()]
    assert tally.answered == 40 and len(records) == 40
    assert sorted(r["custom_id"] for r in records) == sorted(f"id-{i}" for i in range(40))


def test_a_full_output_ends_the_run_with_one_error_line_and_the_summary(caplog):
    """It ended in an ExceptionGroup traceback and no summary."""
    stream = Stream(fail_after=1)  # the first line goes, then the disk is full
    output = BatchOutput(stream, "out.jsonl")
    tally = run_lines(output, 20, max_concurrency=2)
    writes = stream.writes
    assert output.error == os.strerror(errno.ENOSPC) and tally.answered == 1
    assert writes <= 1 + 2 + 1  # the failed write stopped the reading: nothing much more was tried
    assert stream.data.count(b"\n") == 1
    with caplog.at_level(logging.INFO, logger="vlserve.batch"):
        code = conclude(tally, output, types.SimpleNamespace(dead=asyncio.Event(), core=None))
    output.close()
    assert code == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("stopped: 1 answered" in m for m in messages), messages
    assert any(f"cannot write to the output out.jsonl: {os.strerror(errno.ENOSPC)}" in m for m in messages), messages


def test_dev_full_is_a_full_disk():
    done, output = open_output("/dev/full", "-")
    try:
        assert not done
        assert asyncio.run(output.write(b'{"id":"batch_req_1"}\n')) is False
        assert output.error == os.strerror(errno.ENOSPC)
    finally:
        output.close()


def test_a_second_run_on_the_same_output_is_refused(tmp_path):
    """Two runs on one output file wrote every line twice: no lock, no warning."""
    path = str(tmp_path / "out.jsonl")
    _, first = open_output(path, "-")
    try:
        with pytest.raises(ConfigurationError, match="being written by another run"):
            open_output(path, "-")
    finally:
        first.close()
    _, again = open_output(path, "-")  # once the first is over, a run may resume it
    again.close()


def test_an_output_that_is_not_a_file_is_refused_at_once(tmp_path):
    """-o FIFO hung forever (opening a FIFO waits for its reader). A helper process: a hang is a timeout."""
    fifo, sock_path = tmp_path / "fifo", tmp_path / "sock"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    # one helper process tries them all (each import of the package costs seconds): a hang is its timeout
    code = ("import sys\nfrom vlserve.server.run_batch import open_output\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n        open_output(path, '-')\n        print('opened')\n"
            "    except Exception as e:\n        print(type(e).__name__, e)\n")
    kinds = {fifo: "a FIFO", sock_path: "a socket", tmp_path: "a directory"}
    try:
        try:
            out = subprocess.run([sys.executable, "-c", code, *map(str, kinds)], capture_output=True, text=True,
                                 timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("opening a FIFO, a socket or a directory as the output blocked")
        lines = out.stdout.splitlines()
        assert len(lines) == len(kinds), out
        for line, kind in zip(lines, kinds.values()):
            assert line.startswith("ConfigurationError") and "is not a regular file" in line, out
            assert kind in line, line
    finally:
        sock.close()
    done, output = open_output("/dev/null", "-")  # a character device is written to (no resuming, no lock)
    assert not done and asyncio.run(output.write(b"x\n")) is True
    output.close()
