"""The engine process forked from a zygote taken before the front end works (vlserve/engine/zygote.py): used where
it is safe, declined where not (torch already imported, a thread running, VLSERVE_ENGINE_START=spawn), gone with
its front end whether or not it was used. Each case runs in a fresh interpreter (this one has torch loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from vlserve.engine import zygote


def _python(code: str, env: dict | None = None, timeout: float = 60) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # a zombie: ended, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_this_process_declines_because_torch_is_loaded():
    assert "torch" in sys.modules
    assert "torch was imported" in zygote.unsafe_reason()
    assert zygote.prefork(("json",)) is False


FORKED = """
    import os, socket, sys
    from vlserve.engine import zygote
    listener = socket.create_server(("127.0.0.1", 0))
    assert zygote.prefork(("torch",), close=(listener,)) is True
    import torch
    torch.ones(1 << 20).exp_()  # the front end computes after the fork: the zygote is not affected
    engine = ("import os, torch; torch.set_num_threads(2); torch.ones(1 << 22).exp_(); "
              "os.system('cat /proc/$PPID/comm; ls -l /proc/$PPID/fd | grep -c socket:')")
    proc = zygote.start_process(exec, (engine,), name="test")  # its own OpenMP region works (no hang)
    proc.join(30)
    print("exit", proc.exitcode, "pid", proc.pid, "parent", os.getpid())
"""


def test_a_front_end_forks_its_engine_with_torch_loaded_and_without_its_listening_socket():
    out = _python(FORKED)
    lines = out.split()
    # os.system's shell is the engine's child: its parent (the zygote) is named and holds no socket
    assert lines[0] == zygote.ZYGOTE_PROCESS_NAME, out
    assert lines[1] == "0", f"the zygote kept the front end's listening socket: {out}"
    assert "exit 0" in out, out


SPAWNED = """
    import multiprocessing, os, sys
    from vlserve.engine import zygote
    print("forked" if zygote.prefork(("json",)) else "declined", flush=True)
    proc = zygote.start_process(os.getppid, (), name="test")
    proc.join(60)
    print(type(proc._popen).__module__.rsplit(".", 1)[-1], proc.exitcode)
"""


def test_spawn_where_asked_or_where_a_thread_runs_or_torch_came_first():
    assert _python(SPAWNED, env={zygote.START_METHOD_ENV: "spawn"}).split() == ["declined", "popen_spawn_posix", "0"]
    threaded = SPAWNED.replace("from vlserve.engine import zygote",
                               "from vlserve.engine import zygote\n    import threading, time\n    "
                               "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()")
    assert _python(threaded).split()[0] == "declined"
    after_torch = SPAWNED.replace("import multiprocessing", "import torch, multiprocessing")
    assert _python(after_torch).split()[0] == "declined"
    assert _python(SPAWNED).split() == ["forked", "popen_fork", "0"]


UNUSED = """
    import os
    from vlserve.engine import zygote
    assert zygote.prefork(("json",), warm=())
    print(zygote._zygote[0].pid, flush=True)
    if os.environ.get("EXIT_NOW"):
        os._exit(0)  # no clean-up at all: the zygote reads the end of the pipe (or gets SIGTERM) and goes
"""


def test_an_unused_zygote_ends_with_its_front_end():
    for how in ({}, {"EXIT_NOW": "1"}):  # exiting normally (multiprocessing ends it), or outright
        pid = int(_python(UNUSED, env=how).split()[0])
        assert _gone(pid, 10), f"a zygote outlived its front end ({how or 'normal exit'})"


KILLED = """
    import os, signal
    from vlserve.engine import zygote
    assert zygote.prefork(("json",), warm=())
    proc = zygote._zygote[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    started = zygote.start_process(os.getppid, (), name="test")
    started.join(60)
    print(type(started._popen).__module__.rsplit(".", 1)[-1], started.exitcode, zygote._zygote)
"""


def test_a_zygote_killed_before_its_use_gives_way_to_a_spawned_engine():
    assert _python(KILLED).split() == ["popen_spawn_posix", "0", "None"]
