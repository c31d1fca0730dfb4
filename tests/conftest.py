"""Shared fixtures: tiny random checkpoints made once per session, transformers references, test images."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from tests.server_utils import LOG_DIR_ENV
from tests.tiers import TIERS, MissingTier, tier_of
from vlserve.tools.tiny_model import make_tiny_model

ARCHES = ("qwen2_vl", "qwen2_5_vl")
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _threads_per_worker() -> int:
    """2 threads in a serial run; under pytest-xdist (`make test` runs 2 workers) the CPU budget shared by the
    workers, so that their OpenMP pools never outnumber the cores (oversubscribed pools spin and wait on each
    other). OMP_NUM_THREADS carries it to the engines and servers a test starts (they honour it over the budget)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return 2
    from vlserve.core.cpu_budget import cpu_budget

    share = max(1, min(2, cpu_budget().cpus // workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    return int(os.environ["OMP_NUM_THREADS"])


torch.set_num_threads(_threads_per_worker())


def pytest_sessionstart(session):
    """The CPU kernels of these sources: `make install` built them; a checkout whose kernel sources changed since
    compiles its own build once here (servers and engines never compile)."""
    from vlserve.model.kernels import cpu_kernels

    if os.environ.get(cpu_kernels.DISABLE_ENV, "1") == "0":  # kernels off (a GPU machine's run): nothing to build
        return

    cpu_kernels.build()


@pytest.hookimpl(tryfirst=True)  # before `-m` picks tests by these markers
def pytest_collection_modifyitems(config, items):
    """Every test gets exactly one tier marker (tests/tiers.py); a file without one stops the run, so `-m` never
    silently leaves a new file out."""
    costliest: dict = {}  # file -> index in TIERS of its costliest test's tier
    for item in items:
        try:
            tier = tier_of(item.path.name, getattr(item, "originalname", item.name))
        except MissingTier as e:
            raise pytest.UsageError(str(e)) from None
        item.add_marker(tier)
        marked = {m.name for m in item.iter_markers() if m.name in TIERS}
        if marked != {tier}:
            raise pytest.UsageError(f"{item.nodeid} is marked {sorted(marked)}: one tier per test, the one "
                                    "tests/tiers.py gives it")
        costliest[item.path] = max(costliest.get(item.path, 0), TIERS.index(tier))
    # Files of the costliest tiers first (a file's tests stay together, in their order): pytest-xdist hands out
    # files in this order, so the run ends on short unit files instead of one worker finishing a transport
    # matrix while the other waits.
    items.sort(key=lambda item: -costliest[item.path])


@pytest.fixture(scope="session", autouse=True)
def process_logs(tmp_path_factory):
    """The logs of the processes tests start (tests/server_utils.log_file) go under pytest's temporary folder,
    which keeps only the last few runs: a run leaves no files in /tmp."""
    os.environ[LOG_DIR_ENV] = str(tmp_path_factory.mktemp("process-logs"))
    yield


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """arch -> folder of a tiny random checkpoint (initializer_range 0.15 so pictures change the output)."""
    made = {}

    def get(arch: str, size: str = "tiny"):
        if (arch, size) not in made:
            made[arch, size] = make_tiny_model(tmp_path_factory.mktemp(f"{arch}-{size}"), arch=arch, size=size)
        return made[arch, size]

    return get


def noise_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        img = img.convert("RGBA")
        img.putalpha(alpha)
        return img
    return img.convert(mode) if mode != "RGB" else img


def first_step_logprobs(llm, request, **kwargs) -> dict[int, float]:
    """The first generated token's top-5 logprobs. Two inputs whose media reach the language model give different
    numbers even where a random tiny model's greedy tokens happen to agree (torch versions initialise it
    differently), so "the picture / the sound matters" guards compare these, not the tokens."""
    from vlserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    out = llm.generate(request, params, use_tqdm=False, **kwargs)[0]
    return {token: lp.logprob for token, lp in out.outputs[0].logprobs[0].items()}


def assert_pool_full(llm) -> None:
    """No block leaked: after all requests finished every KV block is free and nothing is left queued."""
    sched = llm.engine.core.scheduler
    sched.kv.pool.check_integrity()
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    assert not sched.running and not sched.waiting and not sched.requests
    sched.encoder_cache.check_integrity()
    assert not any(sched.encoder_cache._holders.values()), "an encoder-cache entry is still referenced"


@pytest.fixture
def kernels():
    """vlserve's compiled CPU kernels (the module), or the test is skipped where they are not built."""
    from vlserve.model.kernels import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("vlserve CPU kernels not built here")
    return module


@pytest.fixture
def weight_only_int8(monkeypatch):
    """int8 linears keep their activations in the compute dtype on every path (VLSERVE_INT8_ACTIVATIONS=0): what
    tests of the weight-only arithmetic (the same function on the kernel's rows and past them) need."""
    from vlserve.model.layers import int8_gemm

    monkeypatch.setenv(int8_gemm.ENV_SWITCH, "0")
    int8_gemm.clear_cached_choices()
    yield
    int8_gemm.clear_cached_choices()
