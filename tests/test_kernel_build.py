"""How the CPU kernels are built and found: a build is named by what makes it (so checkouts never rebuild or
invalidate each other's), builders take turns under an OS lock that dies with its holder, and loading never
compiles."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from vlserve.model.kernels import cpu_kernels


def _fake_compile(calls: list):
    def compile_into(tmp: Path):
        calls.append(tmp)
        (tmp / cpu_kernels.LIBRARY).write_bytes(b"not really a library")
        return "module"
    return compile_into


def test_the_build_key_follows_the_sources_not_the_checkout(tmp_path):
    copy = tmp_path / "other-checkout" / "csrc"
    shutil.copytree(cpu_kernels.CSRC, copy)
    assert cpu_kernels.build_key(copy) == cpu_kernels.build_key()  # another clone of the same code: one build
    (copy / "kernels.h").write_text((copy / "kernels.h").read_text() + "\n// changed\n")
    assert cpu_kernels.build_key(copy) != cpu_kernels.build_key()  # changed sources: their own build
    assert cpu_kernels.build_key(compiler="/usr/bin/c++|g++ 99") != cpu_kernels.build_key()


def test_loading_never_compiles(tmp_path, monkeypatch, caplog):
    """With no build for these sources, load() says how to build them and falls back at once; it does not start a
    compiler (which took ~35 s inside a server's first request, and hung for good on a stale lock)."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="vlserve.kernels"):
            t0 = time.monotonic()
            assert cpu_kernels.load() is None
            assert time.monotonic() - t0 < 20
    finally:
        cpu_kernels.load.cache_clear()
    assert "python -m vlserve.model.kernels.cpu_kernels" in caplog.text.replace("python3", "python")
    assert not any(tmp_path.rglob("*")), "loading wrote into the kernel cache"


def test_a_builder_killed_mid_build_leaves_nothing_that_blocks_the_next(tmp_path):
    folder = tmp_path / "cpu-kernels-test"
    script = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from vlserve.model.kernels import cpu_kernels

        def stuck(tmp):
            (tmp / "lock").write_text("")  # what torch's extension builder leaves behind when killed
            print("compiling", flush=True)
            time.sleep(600)

        cpu_kernels.build(Path(sys.argv[1]), compile_into=stuck)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "compiling"  # it holds the lock now
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list(tmp_path.glob("cpu-kernels-test.build-*")), "the killed build left its folder (as a kill does)"
    calls: list = []
    assert cpu_kernels.build(folder, compile_into=_fake_compile(calls)) == folder
    assert len(calls) == 1 and (folder / cpu_kernels.LIBRARY).is_file()
    assert not list(tmp_path.glob("cpu-kernels-test.build-*")), "the dead builder's folder was not swept"


def test_builders_of_one_folder_take_turns_and_compile_once(tmp_path):
    folder = tmp_path / "cpu-kernels-test"
    inside, release = threading.Event(), threading.Event()
    first_calls: list = []

    def slow(tmp: Path):
        inside.set()
        release.wait(30)
        return _fake_compile(first_calls)(tmp)

    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", cpu_kernels.build(folder, compile_into=slow)))
    first.start()
    assert inside.wait(30)
    second_calls: list = []
    second = threading.Thread(target=lambda: results.setdefault(
        "second", cpu_kernels.build(folder, compile_into=_fake_compile(second_calls))))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second builder did not wait for the first"
    assert not (folder / cpu_kernels.LIBRARY).exists(), "half a build is visible"
    release.set()
    first.join(30)
    second.join(30)
    assert results == {"first": folder, "second": folder}
    assert len(first_calls) == 1 and not second_calls, "the second builder compiled again"


def test_a_failed_build_is_reported_and_leaves_no_folder(tmp_path, caplog):
    def broken(tmp: Path):
        raise RuntimeError("no compiler here")

    with caplog.at_level(logging.WARNING, logger="vlserve.kernels"):
        assert cpu_kernels.build(tmp_path / "cpu-kernels-test", compile_into=broken) is None
    assert "no compiler here" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["cpu-kernels-test.lock"]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler here: the torch fallbacks run instead")
def test_the_installed_build_is_found_by_its_key():
    assert cpu_kernels.load().cpu_isa() >= 0
    assert (cpu_kernels.library_dir() / cpu_kernels.LIBRARY).is_file()
