"""`vlserve run-batch`: an OpenAI batch file (JSONL) answered offline, each line by the server's own app in this
process (the same validation, limits, statuses and answers as `vlserve serve`), many at once so the engine
batches them. Results are appended one line at a time as they complete, so a stopped run loses nothing done and
a run on the same output file resumes (batch_files.py says how lines are recognised)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import queue
import signal
import stat
import sys
import threading
from dataclasses import dataclass
from typing import BinaryIO

from vlserve.core.config import SERVE, Options
from vlserve.core.errors import ConfigurationError, VlserveError
from vlserve.core.options import add_options, options_from

logger = logging.getLogger("vlserve.batch")

DEFAULT_MAX_CONCURRENCY = 64
OFF_LOOP_BYTES = 256 * 1024  # answers bigger than this are re-encoded on a thread, not on the event loop
EXIT_SIGTERM = 128 + signal.SIGTERM
RETRY_503_DELAYS = (0.5, 1, 2, 4, 8)  # seconds between tries of a line answered 503 (overloaded)
CLOSE_WAIT_S = 30  # how long the end of a run waits for the output's last writes


@dataclass
class Tally:
    answered: int = 0  # 2xx answers written
    failed: int = 0  # refusals written: the endpoint's (4xx, 5xx) and the lines that never reached one
    skipped: int = 0  # already in the output file
    unanswered: int = 0  # 503 (engine gone, overloaded): not written, so that a later run answers them
    unwritten: int = 0  # answered, but the output failed: a later run answers them again
    blank: int = 0


class BatchOutput:
    """The output, appended to one whole line at a time by one writer thread, in the order the lines are handed
    over: a slow disk or a stdout nobody reads holds that thread, never the event loop. Each line waits for its
    write (`await write`), so at most one line per line in flight is queued. Writes are unbuffered: a killed run
    leaves at most its last line cut short, which the next run drops (batch_files.read_done), and a write that
    fails (a full disk) leaves nothing behind to flush at exit. After a failed write nothing more is written: a
    line cut short stays the last one."""

    def __init__(self, stream: BinaryIO, name: str):
        self.stream, self.name = stream, name  # `stream`: unbuffered (raw) and blocking
        self.error: str | None = None  # why writing stopped: the first failed write's reason
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon: a write stuck on a pipe nobody reads must not keep a stopped run from exiting.
        self._thread = threading.Thread(target=self._write_lines, name="run-batch-output", daemon=True)
        self._thread.start()

    async def write(self, line: bytes) -> bool:
        """False when the line was not written (this write, or an earlier one, failed: see `error`)."""
        loop = asyncio.get_running_loop()
        written = loop.create_future()
        self._lines.put((line, loop, written))
        return await written

    def _write_lines(self) -> None:
        while (item := self._lines.get()) is not None:
            line, loop, written = item
            ok = self.write_now(line)
            with contextlib.suppress(RuntimeError):  # the loop is gone (a stopped run): the line is written anyway
                loop.call_soon_threadsafe(_settle, written, ok)

    def write_now(self, line: bytes) -> bool:
        """`write` on the calling thread (before the run starts, or on the writer thread)."""
        if self.error is not None:
            return False
        view = memoryview(line)
        try:
            while view:  # a raw write may take part of the line (a pipe, a nearly full disk)
                view = view[self.stream.write(view):]
        except OSError as e:
            self.error = e.strerror or str(e)
            return False
        return True

    def close(self) -> None:
        """After the lines handed over are written; the file is left open (to the exit) if a write is stuck."""
        self._lines.put(None)
        self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self.stream.close()


def _settle(written: asyncio.Future, ok: bool) -> None:
    if not written.done():  # not cancelled (a stopped run)
        written.set_result(ok)


# ---- the command -----------------------------------------------------------------------------------------------
def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "run-batch", help="answer an OpenAI batch file (JSONL) offline, with the flags of `serve`",
        description="Reads requests in OpenAI's batch format (one JSON object a line: custom_id, method POST, url "
        "/v1/chat/completions or /v1/responses, body) and writes one result line each in OpenAI's batch output "
        "format, as they complete. Each request goes through the same app as `vlserve serve`. An output file that "
        "exists is resumed: the lines it answers already are skipped. Takes every model and server flag of "
        "`vlserve serve` (without --model: the random demo checkpoint).")
    group = p.add_argument_group("batch")
    group.add_argument("-i", "--input-file", required=True, metavar="FILE",
                       help="the requests, one JSON object a line ('-': standard input)")
    group.add_argument("-o", "--output-file", required=True, metavar="FILE",
                       help="the results, appended to (and resumed from) if it exists ('-': standard output, no "
                       "resuming)")
    group.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, metavar="N",
                       help="lines in flight at once, batched by the engine (default: %(default)s)")
    group.add_argument("--max-batch-line-bytes", type=int, default=None, metavar="N",
                       help="longest input line; a longer one gets an error line (default: --max-request-bytes)")
    add_options(p, SERVE)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from vlserve.server.cli import check_cheap_flags, start_front_end, tensor_parallel_worker, use_demo_checkpoint

    opts = options_from(ns, SERVE)
    check_cheap_flags(opts)
    refuse_serving_only_flags(opts)
    given = ns.max_batch_line_bytes
    max_line_bytes = positive(opts.server.max_request_bytes if given is None else given, "--max-batch-line-bytes")
    max_concurrency = positive(ns.max_concurrency, "--max-concurrency")
    if (code := tensor_parallel_worker(opts.engine)) is not None:
        return code
    start_front_end(imports=("vlserve.frontend.async_llm",))  # lines of tens of MB: see core/allocator.py
    source = open_input(ns.input_file)  # files first: a wrong path is reported before any model loads
    output = None
    try:
        done, output = open_output(ns.output_file, ns.input_file)
        use_demo_checkpoint(opts)
        return asyncio.run(run_batch(opts, ns.log_level, source, output, done, max_line_bytes, max_concurrency,
                                     ns.input_file))
    finally:
        if source is not sys.stdin.buffer:
            source.close()
        if output is not None:
            output.close()  # its lock goes with it


def positive(value: int, flag: str) -> int:
    if value < 1:
        raise ConfigurationError(f"{flag} must be at least 1, got {value}")
    return value


def refuse_serving_only_flags(opts: Options) -> None:
    """Flags that would start other processes or announce a server: meaningless for a batch, so refused rather
    than silently ignored (--host, --port and the like are ignored: a serve command line works as it is)."""
    if opts.disagg.disagg or opts.disagg.num_prefill or opts.disagg.num_decode:
        raise ConfigurationError("run-batch runs one engine in this process: --disagg, --num-prefill and "
                                 "--num-decode are for `vlserve serve`")
    if opts.disagg.registry:
        raise ConfigurationError("run-batch answers no HTTP requests: --registry (announcing a replica to "
                                 "routers) is for `vlserve serve`")


def open_input(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as e:
        raise ConfigurationError(f"cannot read the input file {path}: {e.strerror}") from None


def open_output(path: str, input_path: str):
    """(what the output already holds, the output to append to). A regular file is locked for this run (a second
    run on it would write every line again) and resumed; a character device (/dev/null, a terminal) is only
    written to; anything else (a FIFO would block until a reader came) is refused."""
    from vlserve.server.batch_files import Done, read_done

    if path == "-":
        return Done(), BatchOutput(open(sys.stdout.fileno(), "wb", buffering=0, closefd=False), "standard output")
    if input_path != "-" and os.path.exists(path) and os.path.samefile(path, input_path):
        raise ConfigurationError(f"the output file {path} is the input file: give -o another file")
    fd = _open_output_fd(path)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            _lock(fd, path)
            with os.fdopen(os.dup(fd), "rb") as f:  # the file as it is now, read from its start
                done = read_done(path, f)
        else:
            done = Done()  # a character device: nothing to resume from
        output = BatchOutput(open(fd, "wb", buffering=0), path)
    except BaseException:
        os.close(fd)
        raise
    if done.needs_newline and not output.write_now(b"\n"):
        output.close()
        raise VlserveError(f"cannot write to the output {path}: {output.error}")
    if done:
        logger.info("resuming: %d lines of the input are in %s already and are skipped", len(done), path)
    return done, output


def _open_output_fd(path: str) -> int:
    """`path` opened to read and append (created if missing), without waiting: opening a FIFO for writing would
    wait for a reader. Refused unless a regular file or a character device."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.ENXIO):  # a directory; a socket
            raise ConfigurationError(_not_a_file(path, os.stat(path).st_mode)) from None
        raise ConfigurationError(f"cannot write the output file {path}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
        os.close(fd)
        raise ConfigurationError(_not_a_file(path, mode))
    os.set_blocking(fd, True)  # writes wait for room (a terminal, a slow disk): on the writer thread
    return fd


def _not_a_file(path: str, mode: int) -> str:
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a directory" if stat.S_ISDIR(mode) else "not a file")
    return (f"the output {path} is not a regular file ({kind}): give -o a file (a run resumes from it), or '-' "
            "for standard output")


def _lock(fd: int, path: str) -> None:
    """This run's exclusive lock on the output: a second run on it is refused while this one lasts."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigurationError(f"the output file {path} is being written by another run of run-batch (it holds "
                                 "a lock on it): wait for that run to end, or give -o another file") from None
    except OSError as e:  # a file system without locks: the run goes on, unguarded
        logger.warning("cannot lock the output file %s (%s): make sure no other run writes to it", path,
                       e.strerror or e)


# ---- the run ---------------------------------------------------------------------------------------------------
async def run_batch(opts: Options, log_level: str, source: BinaryIO, output: BatchOutput, done, max_line_bytes: int,
                    max_concurrency: int, input_path: str) -> int:
    """Engine, then every line through the app, then the engine stopped (as `serve` orders them)."""
    import httpx

    from vlserve.core.cpu_budget import size_default_executor
    from vlserve.core.processes import finish
    from vlserve.server.api_server import build_app, make_engine
    from vlserve.server.batch_files import InputLines, count_lines

    size_default_executor(opts.engine.cpu_threads)
    sigterm = stop_on_sigterm()
    tally = Tally()
    try:
        total = asyncio.create_task(asyncio.to_thread(count_lines, input_path))  # while the engine starts
        engine = make_engine(opts, log_level, SERVE)
        await engine.start()
        try:
            headers = {"Authorization": f"Bearer {opts.server.api_key}"} if opts.server.api_key else {}
            transport = httpx.ASGITransport(app=build_app(engine, opts.server), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", headers=headers,
                                         timeout=None) as client:
                lines = InputLines(source, max_line_bytes)
                with progress_bar(await total) as bar:
                    runner = Runner(client, output, tally, bar, engine.dead)
                    await answer_lines(lines, done, runner, engine, max_concurrency)
        finally:
            await finish(engine.shutdown())
    except asyncio.CancelledError:
        summarize(tally, output, "stopped")
        logger.warning("stopped before the end of the input: run the same command again to resume")
        if not sigterm.received:
            raise  # Ctrl-C: asyncio.run raises KeyboardInterrupt, the command exits 130
        return EXIT_SIGTERM
    return conclude(tally, output, engine)


def conclude(tally: Tally, output: BatchOutput, engine) -> int:
    """The summary of a run that ended by itself, and its exit code."""
    stopped = engine.dead.is_set() or output.error is not None
    summarize(tally, output, "stopped" if stopped else "done")
    if output.error is not None:
        logger.error("cannot write to the output %s: %s; the run stopped there: make room and run the same "
                     "command again to answer the lines left", output.name, output.error)
        return 1
    if engine.dead.is_set():
        logger.error("the engine died (%s): run the same command again to answer the lines left",
                     engine.core.dead_reason)
        return 1
    return 1 if tally.unanswered else 0


@dataclass
class SigtermFlag:
    received: bool = False


def stop_on_sigterm() -> SigtermFlag:
    """SIGTERM cancels the run like Ctrl-C: the engine is shut down and what is written stays."""
    flag, task = SigtermFlag(), asyncio.current_task()

    def on_sigterm() -> None:
        flag.received = True
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    return flag


@contextlib.contextmanager
def progress_bar(total: int | None):
    import threading

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    # A thread lock, not tqdm's default multiprocessing one (which a process stopped by a signal leaves behind).
    tqdm.set_lock(threading.RLock())
    interactive = sys.stderr.isatty()
    # Log lines print above the bar instead of through it; in a log file, the bar is a line every 30 s.
    with logging_redirect_tqdm(), tqdm(total=total, unit="line", desc="run-batch", file=sys.stderr,
                                       dynamic_ncols=True, mininterval=0.2 if interactive else 30) as bar:
        yield bar


async def answer_lines(lines, done, runner: "Runner", engine, max_concurrency: int) -> None:
    """Reads a line only when a slot is free (at most max_concurrency + 1 lines held), until the input ends or the
    engine dies. Reading and checking lines (up to --max-batch-line-bytes each) happens on a thread."""
    from vlserve.server.batch_files import LineError

    end = object()
    slots = asyncio.Semaphore(max_concurrency)
    async with asyncio.TaskGroup() as group:
        while not engine.dead.is_set() and runner.output.error is None:
            item = await asyncio.to_thread(next, lines, end)
            if item is end:
                break
            if item is None:
                runner.tally.blank += 1
                runner.bar.update()
            elif done.has(item):
                runner.tally.skipped += 1
                runner.bar.update()
            elif isinstance(item, LineError):
                await runner.write_error(item)
            else:
                await slots.acquire()
                group.create_task(runner.answer(item, slots))


@dataclass
class Runner:
    """Sends one line through the app and writes its result."""

    client: object
    output: BatchOutput
    tally: Tally
    bar: object
    engine_dead: asyncio.Event

    async def answer(self, item, slots: asyncio.Semaphore) -> None:
        from vlserve.server.batch_files import response_line

        try:
            response = await self.post(item)
            if response.status_code == 503:  # not the request's fault: left for a later run
                self.tally.unanswered += 1
                self.bar.update()
                return
            content, status = response.content, response.status_code
            if len(content) > OFF_LOOP_BYTES:
                line = await asyncio.to_thread(response_line, item.custom_id, status, content)
            else:
                line = response_line(item.custom_id, status, content)
            if not await self.output.write(line):
                self.tally.unwritten += 1
            elif 200 <= status < 300:
                self.tally.answered += 1
            else:
                self.tally.failed += 1
            self.bar.update()
        finally:
            slots.release()

    async def post(self, item):
        """The app's answer; a 503 (overloaded: waiting queue, constraint compiles) is tried again a few times while
        the engine lives, as a client of `serve` would."""
        for delay in (*RETRY_503_DELAYS, None):
            response = await self.client.post(item.url, content=item.body,
                                              headers={"content-type": "application/json"})
            if response.status_code != 503 or delay is None or self.engine_dead.is_set():
                return response
            await asyncio.sleep(delay)

    async def write_error(self, error) -> None:
        from vlserve.server.batch_files import error_line

        if await self.output.write(error_line(error)):
            self.tally.failed += 1
        self.bar.update()


def summarize(tally: Tally, output: BatchOutput, how: str) -> None:
    logger.info("run-batch %s: %d answered, %d failed (their errors are in %s), %d skipped (answered by an "
                "earlier run)%s", how, tally.answered, tally.failed, output.name, tally.skipped,
                f", {tally.unanswered} left unanswered (503: the engine was gone or overloaded; run again to answer "
                "them)" if tally.unanswered else "")
    if tally.unwritten:
        logger.info("%d answers were not written (the output failed): a later run answers them again",
                    tally.unwritten)
