"""`vlserve serve --disagg`: a bootstrap, N encoders and a language server on this machine, each its own process
(E->PD); with `--num-prefill P --num-decode D`, P prefill and D decode instances instead of the language server
(E->P->D).

Each child's command line is built from the options (only the flags its role honours), never by editing argv.
The roles' own ports (registry, encoders, prefill instances) are free ports picked at start, or with
--disagg-base-port B: B, B+1, ... in the order role_ports() documents.
Children run in their own session, so a terminal's Ctrl-C reaches only this supervisor, which then stops them
together: every role gets SIGTERM at once and they all stop within one shared deadline (one after another,
E->P->D took 16.6 s); the bootstrap registry goes last, once they have deregistered from it (nothing logs a failed
deregistration). SIGTERM does the same. A child
that dies is restarted with backoff (growing to CRASH_LOOP_BACKOFF_S while it keeps crashing, as a kubelet's
CrashLoopBackOff does); the others keep serving meanwhile, and a crash-looping role never takes them down. A
child that exits with EXIT_CONFIG (a bad --model, a corrupt checkpoint) stops the deployment at once: restarts
would fail the same way. Each child's log lines carry its name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from vlserve.core.config import BOOTSTRAP, DECODE, ENCODE, LANGUAGE, PREFILL, Options
from vlserve.core.cpu_budget import OMP_ENV, cpu_budget
from vlserve.core.errors import EXIT_CONFIG, InvalidInputError
from vlserve.core.options import to_argv
from vlserve.core.processes import DEPLOYMENT_STATE_ENV, LOG_TAG_ENV, die_with_parent, free_port, write_degraded

logger = logging.getLogger("vlserve.disagg")
MAX_RESTARTS = 5  # quick restarts per child within RESTART_WINDOW_S; after that it is crash-looping
RESTART_WINDOW_S = 300.0
CRASH_LOOP_BACKOFF_S = 60.0  # the delay between restarts of a crash-looping child
STOP_TIMEOUT_S = 15.0
POLL_S = 0.2


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    crashes: list[float] = field(default_factory=list)
    restart_at: float | None = None
    serves_api: bool = False  # an API role: on SIGTERM it drains its requests first (--shutdown-timeout)

    def start(self) -> None:
        env = {**os.environ, **self.env, LOG_TAG_ENV: self.name}  # its log lines say which role wrote them
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent if sys.platform == "linux" else None)
        self.restart_at = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float, given_s: float = STOP_TIMEOUT_S) -> None:
        """`given_s`: the whole time it had since its SIGTERM (what the log says), of which `timeout` is left."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0fs of SIGTERM; killing it", self.name, given_s)
            self.proc.kill()
            self.proc.wait()


def role_ports(opts: Options) -> dict[str, int]:
    """The ports of the processes `serve --disagg` starts besides its API (which stays on --port; decode instance i
    on --port + i), by name, in this order: "bootstrap" (not with --registry), then for each encoder i
    "encoder-i" (HTTP) and "encoder-i data", then for each prefill instance i "prefill-i" and "prefill-i data".
    With --disagg-base-port B they are B, B+1, ... in exactly that order; without it (or 0) free ports picked now."""
    d = opts.disagg
    names = [] if d.registry else ["bootstrap"]
    for role, count in (("encoder", d.num_encoders), ("prefill", d.num_prefill)):
        for i in range(count):
            names += [f"{role}-{i}", f"{role}-{i} data"]
    base = d.disagg_base_port
    if not base:
        picked: dict[str, int] = {}
        for name in names:
            port = free_port()
            while port in picked.values():  # two picks in a row may return the same free port
                port = free_port()
            picked[name] = port
        return picked
    ports = {name: base + i for i, name in enumerate(names)}
    if names and base + len(names) - 1 > 65535:
        raise InvalidInputError(f"--disagg-base-port {base}: these roles need {len(names)} ports, up to "
                                f"{base + len(names) - 1}, past 65535; pick a lower base")
    api = range(opts.server.port, opts.server.port + max(1, d.num_decode))
    for name, port in ports.items():
        if port in api:
            raise InvalidInputError(f"--disagg-base-port {base} gives {name} port {port}, which the API takes "
                                    f"(--port {opts.server.port}{' + decode instances' if d.num_decode > 1 else ''})"
                                    f"; pick a base outside {api.start}-{api.stop - 1}")
    return ports


def check_ports_free(ports: dict[str, int], host: str = "127.0.0.1") -> None:
    """Chosen ports (--disagg-base-port) must be free: a taken one is a configuration error naming it, not a role
    crash-looping on its bind."""
    for name, port in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the roles bind: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError as e:
                raise InvalidInputError(f"--disagg-base-port: port {port} ({name}) is not free on {host} ({e.strerror})"
                                        "; pick another base") from None


def plan_children(opts: Options, log_level: str) -> list[Child]:
    """The processes of one deployment, registry first."""
    opts = _split_cpu_threads(opts)
    vlserve = [sys.executable, "-m", "vlserve", "--log-level", log_level]
    children = []
    role_port = role_ports(opts)
    if opts.disagg.registry:  # the roles meet there (their --registry comes with their options)
        meet: list[str] = []
    else:
        boot_port = role_port["bootstrap"]
        meet = ["--bootstrap", f"127.0.0.1:{boot_port}"]
        argv, env = to_argv(opts, BOOTSTRAP)
        children.append(Child("bootstrap", [*vlserve, "bootstrap", *_without(argv, "--host", "--port"), "--host",
                                            "127.0.0.1", "--port", str(boot_port)], env))
    argv, env = to_argv(opts, ENCODE)
    encoders = []
    for i in range(opts.disagg.num_encoders):
        ports = ["--host", "127.0.0.1", "--port", str(role_port[f"encoder-{i}"]), "--data-port",
                 str(role_port[f"encoder-{i} data"])]
        encoders.append(Child(f"encoder-{i}", [*vlserve, "encode", *_without(argv, "--host", "--port"), *ports,
                                               *meet], env))
    children += encoders
    d = opts.disagg
    if not d.num_prefill and not d.num_decode:
        if d.prefill_tensor_parallel_size or d.decode_tensor_parallel_size:
            raise InvalidInputError("--prefill-tensor-parallel-size/--decode-tensor-parallel-size size the "
                                    "instances of E->P->D: add --num-prefill P --num-decode D")
        argv, env = to_argv(opts, LANGUAGE)
        children.append(Child("language", [*vlserve, "language", *argv, *meet], env, serves_api=True))
        return children
    if d.num_prefill < 1 or d.num_decode < 1:
        raise InvalidInputError("E->P->D needs at least one of each: --num-prefill P --num-decode D")
    threads = _threads_each(d.num_encoders + d.num_prefill + d.num_decode, opts.engine.cpu_threads)
    for child in encoders:
        child.env.update(threads)
    argv, env = _role_argv(opts, PREFILL, d.prefill_tensor_parallel_size)
    env = {**env, **threads}
    for i in range(d.num_prefill):
        ports = ["--host", "127.0.0.1", "--port", str(role_port[f"prefill-{i}"]), "--data-port",
                 str(role_port[f"prefill-{i} data"])]
        children.append(Child(f"prefill-{i}", [*vlserve, "prefill", *_without(argv, "--host", "--port"), *ports,
                                               *meet], env))
    argv, env = _role_argv(opts, DECODE, d.decode_tensor_parallel_size)
    env = {**env, **threads}
    events = opts.engine.kv_events_endpoint
    for i in range(d.num_decode):  # the first on the user's port, the others on the ports after it (events too)
        port = ["--port", str(opts.server.port + i)]
        if events is not None:
            port += ["--kv-events-endpoint", nth_endpoint(events, i)]
        children.append(Child(f"decode-{i}", [*vlserve, "decode", *_without(argv, "--port", "--kv-events-endpoint"),
                                              *port, *meet], env, serves_api=True))
    return children


def _role_argv(opts: Options, role: str, ranks: int | None) -> tuple[list[str], dict[str, str]]:
    """A role's command line, at `ranks` tensor-parallel ranks when its own size was given (None: the
    deployment's --tensor-parallel-size)."""
    argv, env = to_argv(opts, role)
    if ranks is None:
        return argv, env
    return [*_without(argv, "--tensor-parallel-size"), "--tensor-parallel-size", str(ranks)], env


def _threads_each(model_roles: int, cpu_threads: int | None = None) -> dict[str, str]:
    """On one machine the roles of E->P->D run at the same time: each gets its share of the CPU budget (affinity
    and cgroup quota, core/cpu_budget.py) rather than all of it (2 cores, encoder + prefill + decode: 1.7x the
    requests/s and a third of the TPOT of every role on both cores, measured with benchmarks/disagg.py). A user's
    OMP_NUM_THREADS wins; --cpu-threads, already split by _split_cpu_threads, wins over both in the roles."""
    if cpu_threads is not None or OMP_ENV in os.environ:
        return {}
    return {OMP_ENV: str(max(1, cpu_budget().cpus // max(1, model_roles)))}


def _split_cpu_threads(opts: Options) -> Options:
    """`serve --disagg --cpu-threads N` with E->P->D: N is this machine's, so each role gets N / roles (E->PD keeps
    all N for each role, as it keeps every core)."""
    d, total = opts.disagg, opts.engine.cpu_threads
    if total is None or not (d.num_prefill and d.num_decode):
        return opts
    share = max(1, total // (d.num_encoders + d.num_prefill + d.num_decode))
    return dataclasses.replace(opts, engine=dataclasses.replace(opts.engine, cpu_threads=share))


def nth_endpoint(endpoint: str, i: int) -> str:
    """tcp://HOST:PORT for the i-th of several instances: PORT + i (a `*` port stays: each binds a free one)."""
    head, _, port = endpoint.rpartition(":")
    return endpoint if port == "*" else f"{head}:{int(port) + i}"


def _without(argv: list[str], *flags: str) -> list[str]:
    """argv minus `flag value` pairs (the encoders' addresses are the launcher's to pick)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


class Supervisor:
    def __init__(self, children: list[Child], state_path: str | None = None, drain_s: float = 0.0):
        """`drain_s`: the API roles' --shutdown-timeout (they finish their requests in flight on SIGTERM)."""
        self.children = children
        self.drain_s = drain_s
        self.stopping = False
        self.shutting_down = False
        self.exit_code = 0
        # Crash-looping roles, reported in the API roles' /ready (they keep serving without them).
        self.state_path = state_path
        self.degraded: dict[str, str] = {}
        if state_path is not None:
            write_degraded(state_path, [])
            for child in children:
                child.env[DEPLOYMENT_STATE_ENV] = state_path

    def _report(self, name: str, problem: str | None) -> None:
        if self.degraded.get(name) == problem:
            return
        if problem is None:
            del self.degraded[name]
            logger.info("%s is up again", name)
        else:
            self.degraded[name] = problem
        if self.state_path is not None:
            write_degraded(self.state_path, [f"{n}: {p}" for n, p in self.degraded.items()])

    def _on_signal(self, signum, _frame) -> None:
        if not self.stopping:
            logger.info("%s: stopping every role", signal.Signals(signum).name)
        elif self.shutting_down:  # a second Ctrl-C: the API roles end their draining requests now
            logger.info("%s again: the roles end their requests in flight now", signal.Signals(signum).name)
            for child in self.children:
                if child.name != "bootstrap":  # it goes last, once the roles have deregistered from it
                    child.stop()
        self.stopping = True

    def run(self) -> int:
        """0 once stopped by a signal; EXIT_CONFIG when a role cannot start with this configuration."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for child in self.children:
                child.start()
            while not self.stopping:
                self._check()
                time.sleep(POLL_S)
        finally:
            self.shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.exit_code

    def _check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    logger.info("restarting %s", child.name)
                    child.start()
                continue
            if child.running:
                if child.name in self.degraded and now - child.crashes[-1] > RESTART_WINDOW_S:
                    self._report(child.name, None)  # it has stayed up for a whole window
                continue
            code = child.proc.returncode
            if code == EXIT_CONFIG:  # the options or the checkpoint are wrong: every restart would fail the same way
                logger.error("%s cannot start with this configuration (see its error above); stopping the "
                             "deployment", child.name)
                self.exit_code, self.stopping = EXIT_CONFIG, True
                return
            child.crashes = [t for t in child.crashes if now - t < RESTART_WINDOW_S] + [now]
            if len(child.crashes) > MAX_RESTARTS:
                logger.error("%s is crash-looping: it exited (code %s) %d times within %.0fs; restarting it every "
                             "%.0fs meanwhile (the other roles keep serving)", child.name, code, len(child.crashes),
                             RESTART_WINDOW_S, CRASH_LOOP_BACKOFF_S)
                child.restart_at = now + CRASH_LOOP_BACKOFF_S
                self._report(child.name, f"crash-looping: exited (code {code}) {len(child.crashes)} times within "
                                         f"{RESTART_WINDOW_S:.0f}s; restarted every {CRASH_LOOP_BACKOFF_S:.0f}s")
                continue
            backoff = min(0.5 * 2 ** (len(child.crashes) - 1), 10.0)
            logger.warning("%s exited (code %s); restarting it in %.1fs (the other roles keep serving)",
                           child.name, code, backoff)
            child.restart_at = now + backoff

    def shutdown(self) -> None:
        """Every role gets SIGTERM at once (API servers first) and they stop side by side within one shared
        deadline, so stopping takes as long as the slowest role, not the sum of them all; the bootstrap registry
        then, once the roles have deregistered from it. With --shutdown-timeout the API roles go first, alone:
        the encoders and prefill instances their requests in flight need keep serving while they drain."""
        self.shutting_down = True
        roles = [c for c in reversed(self.children) if c.name != "bootstrap"]
        registry = [c for c in self.children if c.name == "bootstrap"]
        groups = [roles, registry]
        if self.drain_s > 0:
            groups[0:1] = [[c for c in roles if c.serves_api], [c for c in roles if not c.serves_api]]
        for group in groups:
            for child in group:
                child.stop()
            given = STOP_TIMEOUT_S + (self.drain_s if any(c.serves_api for c in group) else 0)
            deadline = time.monotonic() + given
            for child in group:
                child.wait(deadline - time.monotonic(), given)
        if self.state_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.state_path)


def run_roles(opts: Options, log_level: str) -> int:
    from vlserve.disagg.transports import require_backend

    require_backend(opts.disagg.transfer_backend)  # once here, not in every role's crash loop
    if opts.disagg.disagg_secret is None:  # the roles authenticate each other; children get it in their env
        opts.disagg.disagg_secret = secrets.token_urlsafe(32)
    children = plan_children(opts, log_level)
    d = opts.disagg
    if d.disagg_base_port:
        ports = role_ports(opts)
        check_ports_free(ports)
        logger.info("ports from --disagg-base-port %d: %s", d.disagg_base_port,
                    ", ".join(f"{name} {port}" for name, port in ports.items()))
    api = f"{d.num_prefill} prefill and {d.num_decode} decode instance(s)" if d.num_decode else "a language server"
    where = f"meeting in {d.registry}" if d.registry else "and a bootstrap registry"
    logger.info("starting %d encoder(s) and %s %s, on %s:%d (Ctrl-C or SIGTERM stops all)",
                d.num_encoders, api, where, opts.server.host, opts.server.port)
    fd, state = tempfile.mkstemp(prefix="vlserve-deployment-", suffix=".state")
    os.close(fd)
    return Supervisor(children, state, drain_s=opts.server.shutdown_timeout).run()
