"""The container image's start command, run as the image's non-root user against a kernel cache root built
(issue #53). The Dockerfile compiles the CPU kernels as root into $VLSERVE_KERNEL_CACHE and the Kubernetes
manifests run the image as uid 10001: that user must be able to load the build, and a cache it cannot read (a
build private to root, as every build was before) must cost it the kernels, never the start.

No Docker here: the cache is built by this test process through cpu_kernels.build() (the Dockerfile's build step),
and the image's ENTRYPOINT (`vlserve`, run as `python -m vlserve`) starts `serve` on a tiny checkpoint in a child
process. Run as root, the child runs as the image's uid; run as any other user, as that user, against a build
made unreadable to it (chmod 000: an owner cannot pass that either)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import HTTP, free_port, stop
from vlserve.core.processes import die_with_parent
from vlserve.model.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IMAGE_UID = int(re.search(r"useradd --uid (\d+)", DOCKERFILE).group(1))
ENTRYPOINT = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", DOCKERFILE, re.MULTILINE).group(1))
AS_ROOT = os.geteuid() == 0
PROBE = ("import subprocess, sys, torch, vlserve; "  # what serve does: import, then spawn its engine process
         "sys.exit(subprocess.call([sys.executable, '-c', 'import vlserve']))")

pytestmark = pytest.mark.skipif(os.environ.get(cpu_kernels.DISABLE_ENV, "1") == "0",
                                reason=f"{cpu_kernels.DISABLE_ENV}=0: no kernels to load")


def _public_dir(prefix: str) -> Path:
    """A temporary folder the image user can read (pytest's tmp_path is private to whoever runs the tests)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


class ImageUser:
    """How to run a command as the image's user: uid (setuid in the child when this process is root) and an
    interpreter of this environment that user can execute."""

    def __init__(self, uid: int, python: str, home: Path):
        self.uid, self.python, self.home = uid, python, home

    def popen(self, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        who = {"user": self.uid, "group": self.uid, "extra_groups": []} if AS_ROOT else {}
        return subprocess.Popen(argv, env={**os.environ, "HOME": str(self.home), **env}, cwd=self.home,
                                start_new_session=True, preexec_fn=die_with_parent, **who, **kwargs)

    def runs(self) -> str | None:
        """None when this user can run vlserve with self.python (and start another interpreter from it), else why
        not."""
        try:
            proc = self.popen([self.python, "-c", PROBE], {}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
            out, _ = proc.communicate(timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        lines = out.strip().splitlines()
        return None if proc.returncode == 0 else lines[-1] if lines else f"exit {proc.returncode}"


def _shim_venv(folder: Path) -> str | None:
    """A venv of this environment's packages around a system interpreter of the same version: for a test machine
    whose own interpreter lives where the image user cannot go (pyenv under root's 0700 home)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")
    if base is None:
        return None
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(base)
    (folder / "pyvenv.cfg").write_text(f"home = {Path(base).parent}\ninclude-system-site-packages = false\n")
    site = folder / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    (site / "this_environment.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755)
    return str(folder / "bin" / "python")


@pytest.fixture(scope="module")
def image_user():
    uid = IMAGE_UID if AS_ROOT else os.getuid()
    home = _public_dir("vlserve-image-home-")
    if AS_ROOT:
        os.chown(home, uid, uid)
    made = [home]
    try:
        user = ImageUser(uid, sys.executable, home)
        why = user.runs()
        if why is not None:
            shim = _public_dir("vlserve-image-python-")
            made.append(shim)
            user.python = _shim_venv(shim) or sys.executable
            why = user.runs()
        if why is not None:
            pytest.skip(f"uid {uid} cannot run this environment's interpreter: {why}")
        yield user
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model():
    from vlserve.tools.tiny_model import make_tiny_model

    folder = _public_dir("vlserve-image-model-")
    try:
        model = make_tiny_model(folder / "tiny", arch="qwen2_vl")
        for path in folder.rglob("*"):  # as a models volume would be: readable by the pod's user
            path.chmod(path.stat().st_mode | stat.S_IRGRP | stat.S_IROTH | (0o055 if path.is_dir() else 0))
        yield model
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def root_built_cache():
    """$VLSERVE_KERNEL_CACHE as the image's build step leaves it: built by this (root) process with build(). The
    library is this checkout's real build when there is one (so loading it must succeed), else a stand-in."""
    cache = _public_dir("vlserve-image-kernels-")  # the Dockerfile's /opt/vlserve/kernels
    real = cpu_kernels.library_dir() / cpu_kernels.LIBRARY if cpu_kernels.load() is not None else None

    def compile_into(tmp: Path):
        if real is not None:
            shutil.copy(real, tmp / cpu_kernels.LIBRARY)
        else:
            (tmp / cpu_kernels.LIBRARY).write_bytes(b"not a library: no compiler on this machine")

    with pytest.MonkeyPatch.context() as env:  # where the image's build step puts it (as the code under test says)
        env.setenv(cpu_kernels.CACHE_ENV, str(cache))
        folder = cpu_kernels.build(compile_into=compile_into)
    assert folder is not None and folder.is_relative_to(cache)
    try:
        yield cache, folder, real is not None
    finally:
        folder.chmod(0o755)
        shutil.rmtree(cache, ignore_errors=True)


def _start_and_stop(user: ImageUser, model: Path, cache: Path, log: Path) -> str:
    """The image's start command (ENTRYPOINT + a role) as the image user: healthy, then stopped. Its log."""
    assert ENTRYPOINT == ["vlserve"], "the manifests' args start with the role"
    port = free_port()
    with open(log, "w") as out:
        proc = user.popen([user.python, "-m", *ENTRYPOINT, "serve", "--model", str(model), "--host", "127.0.0.1",
                           "--port", str(port)],
                          {cpu_kernels.CACHE_ENV: str(cache), "OMP_NUM_THREADS": "1"},
                          stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if HTTP.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"the start command did not become healthy (exit {proc.returncode}):\n"
                                 f"{log.read_text()[-4000:]}")
        assert HTTP.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
        uid = next(int(line.split()[1]) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))
        assert uid == user.uid != 0, "the start command ran as root"
    finally:
        stop(proc)
    return log.read_text()


def test_the_image_starts_as_its_user_with_the_kernels_root_built(image_user, tiny_model, root_built_cache,
                                                                     tmp_path):
    cache, folder, real = root_built_cache
    log = _start_and_stop(image_user, tiny_model, cache, tmp_path / "serve.log")
    assert "PermissionError" not in log and "cannot be read" not in log, log[-4000:]
    if real:
        assert f"vlserve CPU kernels loaded from {folder}" in log, log[-4000:]
    else:  # the stand-in is found and read (then refused as no library): what matters is that it could be read
        assert "could not be loaded" in log, log[-4000:]


def test_the_image_starts_as_its_user_when_the_kernels_are_private_to_root(image_user, tiny_model,
                                                                          root_built_cache, tmp_path):
    """A build this user cannot read (made private by an older builder, or a root umask of 077): a warning that
    names the fix, the torch paths, a server that answers."""
    cache, folder, _ = root_built_cache
    folder.chmod(0o700 if AS_ROOT else 0o000)
    log = _start_and_stop(image_user, tiny_model, cache, tmp_path / "serve.log")
    assert "Traceback" not in log, log[-4000:]
    assert "cannot be read by this user" in log and cpu_kernels.CACHE_ENV in log, log[-4000:]
    assert "kernels loaded from" not in log
