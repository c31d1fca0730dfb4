"""What a newcomer tripped on (issue #53), in this process: where VLSERVE_KERNEL_CACHE puts the builds, a build
other users can read and a cache this user cannot read or write (a warning, never an error), the Dockerfile's
kernel build, `make serve`'s address flags, `serve --disagg --disagg-base-port`, stopping every role together,
and benchmarks/cache_effect.py cleaning up its checkpoint and saying how noisy its speed-up is.
(tests/test_kernel_cache_access.py runs the image's start command as a non-root user.)"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from vlserve.model.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_load():
    """load() caches its answer for the process: tests that point it elsewhere leave no answer behind."""
    cpu_kernels.load.cache_clear()
    yield
    cpu_kernels.load.cache_clear()


def _fake_compile(tmp: Path):
    (tmp / cpu_kernels.LIBRARY).write_bytes(b"not really a library")


# ---------------------------------------------------------------------------------------------- kernel cache


def test_vlserve_kernel_cache_is_the_folder_that_holds_the_builds(tmp_path, monkeypatch, fresh_load):
    """No hidden `vlserve/` level below it; an old build in that level stays untouched and in nobody's way."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    assert cpu_kernels.cache_root() == tmp_path
    name = cpu_kernels.library_dir().name
    assert cpu_kernels.library_dir() == tmp_path / name
    old = tmp_path / "vlserve" / name  # where versions before this one built
    old.mkdir(parents=True)
    (old / cpu_kernels.LIBRARY).write_bytes(b"an old build")
    assert cpu_kernels.build(compile_into=_fake_compile) == tmp_path / name
    assert (tmp_path / name / cpu_kernels.LIBRARY).is_file()
    assert (old / cpu_kernels.LIBRARY).read_bytes() == b"an old build"
    monkeypatch.delenv(cpu_kernels.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_kernels.cache_root() == tmp_path / "xdg" / "vlserve"  # the per-user default keeps its level
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cpu_kernels.cache_root() == Path.home() / ".cache" / "vlserve"


def test_a_build_is_readable_by_every_user(tmp_path):
    """A build is compiled in a private temporary folder (0700) and renamed into place: it must come out as a
    plain mkdir would, or root's build (the Docker image's) is unreadable to the uid that serves."""
    mask = os.umask(0o022)
    try:
        folder = cpu_kernels.build(tmp_path / "cpu-kernels-test", compile_into=_fake_compile)
    finally:
        os.umask(mask)
    assert folder is not None
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / cpu_kernels.LIBRARY).stat().st_mode) & 0o044 == 0o044


def _unreadable(monkeypatch, below: Path) -> None:
    """As a cache root built, private to root, looks to uid 10001 (chmod cannot stop a test run as root)."""
    is_file = pathlib.Path.is_file

    def denied(self):
        if str(self).startswith(str(below)):
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(pathlib.Path, "is_file", denied)


def test_an_unreadable_kernel_cache_is_a_warning_and_the_torch_paths(tmp_path, monkeypatch, caplog, fresh_load):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    _unreadable(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="vlserve.kernels"):
        assert cpu_kernels.load() is None
        assert cpu_kernels.for_tensor(torch.ones(4)) is None  # every layer's check: the torch path, no error
    text = caplog.text
    assert "cannot be read by this user" in text and cpu_kernels.CACHE_ENV in text and "chmod -R a+rX" in text


def test_an_unwritable_kernel_cache_is_a_warning_when_building(tmp_path, monkeypatch, caplog, fresh_load):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    _unreadable(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="vlserve.kernels"):
        assert cpu_kernels.build(compile_into=_fake_compile) is None
    assert "cannot be built here (PermissionError" in caplog.text and cpu_kernels.CACHE_ENV in caplog.text


def test_the_image_serves_on_every_address_with_triton_s_compiler_and_no_cuda_wheels_on_the_cpu_variant():
    """`docker run -p 8000:8000 vlserve` reaches a server (0.0.0.0, not 127.0.0.1); the CUDA variant's runtime base
    gets the C compiler and Python headers Triton builds its launcher with; the CPU variant skips NIXL's CUDA
    wheel (pyproject's `mooncake` extra, not `disagg`)."""
    import tomllib

    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'CMD \["serve", "--host", "0\.0\.0\.0"\]', text)
    cuda = text[text.index("AS base-cuda"):text.index("FROM base-${VARIANT}")]
    for package in ("gcc", "python3-dev", "libc6-dev"):
        assert package in cuda, package
    assert 'extras=disagg; else extras=mooncake' in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("nixl" in dep for dep in extras["mooncake"])
    assert extras["disagg"] == ["vlserve[mooncake,nixl]"]
    readme = (ROOT / "README.md").read_text()
    assert "docker run --rm -p 127.0.0.1:8000:8000" in readme


def test_the_dockerfile_builds_its_kernels_where_its_user_reads_them():
    text = (ROOT / "Dockerfile").read_text()
    cache = re.search(r"VLSERVE_KERNEL_CACHE=(\S+)", text).group(1)
    build = text.index("python -m vlserve.model.kernels.cpu_kernels")
    readable = text.index('chmod -R a+rX "$VLSERVE_KERNEL_CACHE"')
    uid = re.search(r"useradd --uid (\d+)", text).group(1)
    assert build < readable < text.index(f"USER {uid}"), "the kernels the image serves with are readable by its user"
    assert cache.startswith("/opt/"), "a folder outside root's home (0700)"


# ---------------------------------------------------------------------------------------------- make serve


def make_serve(*make_args: str, env: dict | None = None) -> list[str]:
    """The flags `make serve ...` gives `vlserve serve` (printed with make -n, not run)."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    # (ARGS too: `make test ARGS=...` puts it in this process's environment, and make reads it from there)
    base = {k: v for k, v in os.environ.items()
            if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(ROOT), "serve", *make_args],
                         check=False, capture_output=True, text=True, timeout=60,
                         env={**base, **(env or {})})
    assert out.returncode == 0, out.stderr
    line = [x for x in out.stdout.splitlines() if " -m vlserve serve" in x][-1]
    words = shlex.split(line)
    return words[words.index("serve") + 1:]


def test_make_serve_writes_each_address_flag_once():
    from vlserve.cli import build_parser

    assert make_serve() == ["--host", "127.0.0.1", "--port", "8000"]
    assert make_serve("ARGS=--port 9001") == ["--host", "127.0.0.1", "--port", "9001"]
    assert make_serve("ARGS=--port=9001 --host=0.0.0.0") == ["--port=9001", "--host=0.0.0.0"]
    assert make_serve("PORT=9002", "HOST=0.0.0.0") == ["--host", "0.0.0.0", "--port", "9002"]
    flags = make_serve("ARGS=--model M --dtype bfloat16 --port 9003")
    assert flags == ["--host", "127.0.0.1", "--model", "M", "--dtype", "bfloat16", "--port", "9003"]
    ns = build_parser().parse_args(["serve", *flags])
    assert (ns.host, ns.port, ns.model) == ("127.0.0.1", 9003, "M")
    # A PORT or HOST some environments export is not taken for the server's address.
    assert make_serve(env={"PORT": "1", "HOST": "example.invalid"}) == ["--host", "127.0.0.1", "--port", "8000"]


def test_make_serve_installs_what_serving_needs_and_make_test_the_rest(tmp_path):
    """On a fresh machine `make serve` installs torch and vlserve only (no transports' libraries, no test
    packages, no Triton on a CPU, no system packages): the tests' and the transports' come with `make test` and
    `make install-disagg`."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    base = {k: v for k, v in os.environ.items()
            if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")}

    def planned(target: str) -> str:  # what make would run, with no .venv yet
        out = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(ROOT), target,
                              f"VENV={tmp_path / 'fresh'}"], check=False, capture_output=True, text=True,
                             timeout=60, env=base)
        assert out.returncode == 0, out.stderr
        return out.stdout

    serve = planned("serve")
    assert "pip install --quiet torch==2.13.0" in serve and "pip install --quiet -e ." in serve
    for extra in ("[test", "disagg]", "triton", "apt-get", "chromium", "etcd"):
        assert extra not in serve, extra
    test = planned("test")
    for extra in ("'.[test,disagg,dynamo]'", "triton==", "etcd-server", "libibverbs1", "ai-dynamo==1.6.1",
                  "nats-server"):
        assert extra in test, extra
    assert "dynamo" not in serve
    assert "'.[disagg]'" in planned("install-disagg")


def test_a_role_with_a_backend_whose_library_is_missing_says_what_to_install(monkeypatch):
    from vlserve.core.errors import EXIT_CONFIG, ConfigurationError, exit_code
    from vlserve.disagg import transports

    def missing():
        raise ImportError("--transfer-backend mooncake needs Mooncake's transfer engine")

    monkeypatch.setitem(transports._LIBRARIES, "mooncake", missing)
    with pytest.raises(ConfigurationError, match="make install-disagg") as e:
        transports.require_backend("mooncake")
    assert exit_code(e.value) == EXIT_CONFIG
    transports.require_backend("zmq")  # nothing to install


# ---------------------------------------------------------------------------------------------- disagg ports


def disagg_opts(**disagg):
    from vlserve.core.config import Options

    opts = Options()
    opts.engine.model = "/m"
    for k, v in disagg.items():
        setattr(opts.disagg, k, v)
    return opts


def flag(child, name: str) -> str:
    return child.argv[child.argv.index(name) + 1]


def test_disagg_base_port_gives_the_roles_consecutive_ports_in_the_documented_order():
    from vlserve.disagg.launcher import plan_children, role_ports

    opts = disagg_opts(disagg=True, num_encoders=2, num_prefill=1, num_decode=2, disagg_base_port=9100)
    assert role_ports(opts) == {"bootstrap": 9100, "encoder-0": 9101, "encoder-0 data": 9102, "encoder-1": 9103,
                                "encoder-1 data": 9104, "prefill-0": 9105, "prefill-0 data": 9106}
    children = {c.name: c for c in plan_children(opts, "INFO")}
    assert flag(children["bootstrap"], "--port") == "9100" and children["bootstrap"].argv.count("--port") == 1
    for name, port in (("encoder-0", 9101), ("encoder-1", 9103), ("prefill-0", 9105)):
        assert (flag(children[name], "--port"), flag(children[name], "--data-port")) == (str(port), str(port + 1))
        assert children[name].argv.count("--port") == 1
    for name in ("encoder-0", "encoder-1", "prefill-0", "decode-0", "decode-1"):
        assert flag(children[name], "--bootstrap") == "127.0.0.1:9100"
    assert [flag(children[f"decode-{i}"], "--port") for i in (0, 1)] == ["8000", "8001"]  # the API: --port, + i
    assert not any("--disagg-base-port" in c.argv for c in children.values())  # the launcher's own flag

    # Meeting in a registry: no bootstrap, so the encoders start at the base; E->PD's language server keeps --port.
    opts = disagg_opts(disagg=True, num_encoders=1, disagg_base_port=9200, registry="etcd://127.0.0.1:2379")
    assert role_ports(opts) == {"encoder-0": 9200, "encoder-0 data": 9201}
    children = {c.name: c for c in plan_children(opts, "INFO")}
    assert set(children) == {"encoder-0", "language"} and "--port" not in children["language"].argv


def test_without_a_base_port_the_roles_get_distinct_free_ports():
    from vlserve.disagg.launcher import role_ports

    for base in (None, 0):
        ports = role_ports(disagg_opts(disagg=True, num_encoders=3, num_prefill=2, num_decode=1,
                                       disagg_base_port=base))
        assert len(ports) == 11 and len(set(ports.values())) == 11 and 8000 not in ports.values()


def test_a_base_port_the_roles_cannot_use_is_refused_naming_the_flag():
    from vlserve.cli import build_parser
    from vlserve.core.config import ENCODE, SERVE
    from vlserve.core.errors import ConfigurationError, InvalidInputError, exit_code
    from vlserve.core.options import options_from, to_argv
    from vlserve.disagg.launcher import check_ports_free, role_ports

    with pytest.raises(InvalidInputError, match="--disagg-base-port 65533: .* 5 ports, up to 65537") as e:
        role_ports(disagg_opts(disagg=True, num_encoders=2, disagg_base_port=65533))
    assert exit_code(e.value) == 78
    with pytest.raises(InvalidInputError, match="gives encoder-0 port 8000, which the API takes"):
        role_ports(disagg_opts(disagg=True, num_encoders=1, disagg_base_port=7999))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidInputError, match=f"port {port} \\(encoder-0 data\\) is not free"):
            check_ports_free({"encoder-0 data": port})

    ns = build_parser().parse_args(["serve", "--disagg", "--disagg-base-port", "9100"])
    opts = options_from(ns, SERVE)
    assert opts.disagg.disagg_base_port == 9100
    assert "--disagg-base-port" not in to_argv(opts, ENCODE)[0]
    with pytest.raises(ConfigurationError, match="--disagg-base-port must be between 0 and 65535"):
        options_from(build_parser().parse_args(["serve", "--disagg", "--disagg-base-port", "70000"]), SERVE)


# ---------------------------------------------------------------------------------------------- stopping


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeProc:
    """A child that exits `exit_after` seconds (of the fake clock) after its SIGTERM."""

    def __init__(self, name: str, calls: list, clock: Clock, exit_after: float = 1.0):
        self.name, self.calls, self.clock, self.exit_after = name, calls, clock, exit_after
        self.exit_at = math.inf
        self.returncode = None

    def poll(self):
        if self.returncode is None and self.clock.now >= self.exit_at:
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig):
        self.calls.append(("SIGTERM" if sig == signal.SIGTERM else sig, self.name))
        self.exit_at = self.clock.now + self.exit_after

    def wait(self, timeout=None):
        self.calls.append(("wait", self.name))
        if timeout is None or self.clock.now + timeout >= self.exit_at:
            self.clock.now = max(self.clock.now, self.exit_at)
            self.returncode = 0
            return 0
        self.clock.now += timeout
        raise subprocess.TimeoutExpired(self.name, timeout)

    def kill(self):
        self.calls.append(("kill", self.name))
        self.exit_at = self.clock.now


def supervisor_of(names, monkeypatch, exit_after=None):
    from vlserve.disagg import launcher

    clock, calls = Clock(), []
    monkeypatch.setattr(launcher.time, "monotonic", clock)
    children = []
    for name in names:
        child = launcher.Child(name, ["true"], {})
        child.proc = FakeProc(name, calls, clock, (exit_after or {}).get(name, 1.0))
        children.append(child)
    return launcher.Supervisor(children), calls, clock


def test_every_role_gets_sigterm_before_any_is_waited_for(monkeypatch):
    """E->P->D stopped role after role (16.6 s): now every role is told at once and they stop side by side, so
    five roles that each take 1 s to exit stop in 1 s (of the fake clock), not 5; the registry last, once the
    roles have deregistered from it."""
    roles = ["encoder-0", "encoder-1", "prefill-0", "decode-0", "decode-1"]
    sup, calls, clock = supervisor_of(["bootstrap", *roles], monkeypatch)
    sup.shutdown()
    first_wait = calls.index(next(c for c in calls if c[0] == "wait"))
    assert sorted(calls[:first_wait]) == sorted(("SIGTERM", r) for r in roles), calls
    assert calls[first_wait:first_wait + len(roles)] == [("wait", r) for r in reversed(roles)]
    assert calls[-2:] == [("SIGTERM", "bootstrap"), ("wait", "bootstrap")], "the registry stops last"
    assert clock.now == 2.0  # 1 s for all the roles together, then 1 s for the registry
    assert all(c.proc.returncode == 0 for c in sup.children)


def test_one_deadline_is_shared_and_a_role_that_never_stops_is_killed_at_it(monkeypatch, caplog):
    from vlserve.disagg.launcher import STOP_TIMEOUT_S

    sup, calls, clock = supervisor_of(["encoder-0", "prefill-0", "decode-0"], monkeypatch,
                                      exit_after={"prefill-0": math.inf})
    with caplog.at_level(logging.WARNING, logger="vlserve.disagg"):
        sup.shutdown()
    assert ("kill", "prefill-0") in calls and "prefill-0 did not stop" in caplog.text
    assert clock.now == STOP_TIMEOUT_S  # one deadline for all, not one per role
    assert not any(c[0] == "kill" and c[1] != "prefill-0" for c in calls)


def test_with_a_shutdown_timeout_the_api_roles_drain_first_and_are_not_killed_meanwhile(monkeypatch):
    """`serve --disagg --shutdown-timeout 60`: the API roles get SIGTERM first, alone (the prefill instances and
    encoders their requests in flight need keep serving), and are given the 60 s on top of the usual deadline."""
    from vlserve.disagg.launcher import STOP_TIMEOUT_S

    sup, calls, clock = supervisor_of(["bootstrap", "encoder-0", "prefill-0", "decode-0"], monkeypatch,
                                      exit_after={"decode-0": STOP_TIMEOUT_S + 30})
    sup.children[-1].serves_api, sup.drain_s = True, 60.0
    sup.shutdown()
    assert calls[:2] == [("SIGTERM", "decode-0"), ("wait", "decode-0")], calls
    assert ("kill", "decode-0") not in calls and clock.now >= STOP_TIMEOUT_S + 30
    assert sorted(calls[2:4]) == [("SIGTERM", "encoder-0"), ("SIGTERM", "prefill-0")], calls
    assert calls[-2:] == [("SIGTERM", "bootstrap"), ("wait", "bootstrap")]


def test_a_second_ctrl_c_while_the_roles_stop_reaches_them(monkeypatch):
    """The roles drain on the first SIGTERM; a second Ctrl-C at the supervisor ends their drain at once. The
    bootstrap registry still goes last, once the roles have deregistered (before, it got SIGTERM with them)."""
    sup, calls, _ = supervisor_of(["bootstrap", "encoder-0", "decode-0"], monkeypatch)
    sup._on_signal(signal.SIGINT, None)  # the supervisor's loop then shuts the roles down
    assert calls == []
    sup.shutting_down = True
    sup._on_signal(signal.SIGINT, None)
    assert sorted(calls) == [("SIGTERM", "decode-0"), ("SIGTERM", "encoder-0")]


def test_the_kill_log_says_the_deadline_a_draining_role_had(monkeypatch, caplog):
    """A draining API role is given --shutdown-timeout on top of the usual deadline: the log said only the usual."""
    from vlserve.disagg.launcher import STOP_TIMEOUT_S

    sup, calls, _ = supervisor_of(["decode-0"], monkeypatch, exit_after={"decode-0": math.inf})
    sup.children[0].serves_api, sup.drain_s = True, 60.0
    with caplog.at_level(logging.WARNING, logger="vlserve.disagg"):
        sup.shutdown()
    assert ("kill", "decode-0") in calls
    assert f"did not stop within {STOP_TIMEOUT_S + 60:.0f}s of SIGTERM" in caplog.text, caplog.text


# ---------------------------------------------------------------------------------------------- cache_effect.py


def load_cache_effect():
    spec = importlib.util.spec_from_file_location("cache_effect_bench", ROOT / "benchmarks" / "cache_effect.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeLLM:
    fail = False

    def __init__(self, model, **kwargs):
        assert Path(model, "model.safetensors").is_file()
        if FakeLLM.fail:
            raise RuntimeError("out of memory")

    def generate(self, reqs, params, use_tqdm=False):
        reqs = reqs if isinstance(reqs, list) else [reqs]
        return [NS(outputs=[NS(token_ids=[1] * params.max_tokens)]) for _ in reqs]

    def get_metrics(self):
        return {"prefix_cache_hits_total": 0, "prefix_cache_queries_total": 0, "encoder_cache_hits_total": 0,
                "encoder_cache_queries_total": 0}


def test_cache_effect_removes_its_checkpoint_and_reports_the_spread(monkeypatch, capsys):
    from vlserve.tools import tiny_model

    bench = load_cache_effect()
    made = []

    def make_tiny_model(out, arch, size):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"\0" * 4096)  # 459 MB for a medium one
        made.append(out)
        return out

    monkeypatch.setattr(tiny_model, "make_tiny_model", make_tiny_model)
    monkeypatch.setattr(bench, "LLM", FakeLLM)
    monkeypatch.setattr(sys, "argv", ["cache_effect.py", "--num-requests", "3", "--rounds", "1"])
    bench.main()
    out = capsys.readouterr().out
    assert made and not made[-1].exists() and not made[-1].parent.exists(), "the temporary checkpoint was left"
    assert re.search(r"speed-up with caches: median \d+\.\d\dx \(min \d+\.\d\dx - max \d+\.\d\dx over 3 repeats",
                     out), out
    monkeypatch.setattr(FakeLLM, "fail", True)
    with pytest.raises(RuntimeError, match="out of memory"):
        bench.main()
    assert len(made) == 2 and not made[-1].parent.exists(), "a failed run left its checkpoint"


def test_cache_effect_says_when_its_speed_up_is_noise():
    spread = load_cache_effect().spread
    assert spread([1.5, 1.3, 1.4]) == "median 1.40x (min 1.30x - max 1.50x over 3 repeats)"
    assert "noise" in spread([0.77, 1.05, 0.95])  # the 0.77x a newcomer saw, without a word about noise
    assert "noise" in spread([0.77])


def test_free_ports_come_from_outside_the_kernels_ephemeral_range(monkeypatch):
    """A port the kernel picked for a bind to port 0 goes back to its pool once checked; a transport library's
    listener or a gloo rank binding port 0 meanwhile could be handed it (an encoder then failed to bind its data
    port). free_port picks from outside that pool, at random, and only a port it could bind and
    had not handed out lately (a prefill instance's ports were once drawn twice)."""
    import socket

    from vlserve.core import processes

    ephemeral = processes._ephemeral_ports()
    ports = {processes.free_port() for _ in range(20)}
    assert not any(p in ephemeral for p in ports), (ports, ephemeral)
    assert len(ports) == 20  # never one it handed out lately (a role's ports are asked for one after another)
    taken = {p: socket.socket() for p in sorted(ports)[:1]}
    for port, s in taken.items():  # a port something holds is never handed out
        s.bind(("127.0.0.1", port))
    try:
        monkeypatch.setattr(processes.random.SystemRandom, "choice", lambda self, pool: next(iter(taken)))
        fallback = processes.free_port()  # every pick is taken: the kernel's choice
        assert fallback not in taken and fallback in ephemeral
    finally:
        for s in taken.values():
            s.close()
