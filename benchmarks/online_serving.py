"""Online serving: the same `vlserve bench serve` load against `vlserve serve` and, when given, vLLM-CPU's server.

Each server is started fresh (no warm caches), loaded with the same seeded multimodal workload (pictures of
several sizes, some repeated, random prompts, ignore_eos so output lengths match), then stopped. Prints both
rows and the ratios, in one run on the same machine.

    .venv/bin/python benchmarks/online_serving.py [--model DIR] [--vllm-venv /path/to/vllm-venv]
        [--num-prompts 32] [--max-concurrency 8] [--output-len 64]

vLLM-CPU set-up: ../shared/peers/README.md (setup_venv.sh DIR; 2-core environment variables are set here).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server_utils import free_port  # noqa: E402

ROWS = [("output_throughput", "output tok/s", 1), ("request_throughput", "req/s", 1),
        ("median_ttft_ms", "TTFT median ms", -1), ("p99_ttft_ms", "TTFT p99 ms", -1),
        ("median_tpot_ms", "TPOT median ms", -1), ("median_e2el_ms", "E2E median ms", -1)]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not come up")


def vllm_env(venv: Path) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "4"}
    preload = glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4") + \
        glob.glob(str(venv / "lib" / "libiomp5.so")) + glob.glob(str(venv / "lib/python3*/site-packages/*/lib/libiomp5.so"))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload[:2])
    return env


def run_one(name: str, cmd: list[str], env: dict, port: int, bench_args: list[str], start_timeout: float) -> dict:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    print(f"[{name}] starting: {' '.join(cmd)} (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.monotonic()
        wait_healthy(f"http://127.0.0.1:{port}", proc, start_timeout)
        print(f"[{name}] up in {time.monotonic() - t0:.0f} s; running the load", flush=True)
        result = Path(tempfile.mkdtemp()) / "result.json"
        subprocess.run([sys.executable, "-m", "vlserve", "--log-level", "WARNING", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", "--result-file", str(result), "--disable-tqdm", *bench_args],
                       check=True)
        return json.loads(result.read_text())["metrics"]
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen, wait_s: float = 60) -> None:
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's where this CPU computes it natively, "
                    "else float32")
    ap.add_argument("--vllm-venv", type=Path,
                    help="the venv inside the folder ../shared/peers/vllm_cpu/setup_venv.sh made (DIR/venv)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--image-sizes", default="224x224,448x448,336x252")
    ap.add_argument("--repeat-image-ratio", type=float, default=0.3)
    args = ap.parse_args()

    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_vl", size="medium"))
    bench = ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
             "--output-len", str(args.output_len), "--input-len", str(args.input_len), "--image-sizes",
             args.image_sizes, "--repeat-image-ratio", str(args.repeat_image_ratio), "--seed", "0"]
    # vLLM has its own "auto": both servers get the dtype vlserve's rule picks for this CPU.
    from vlserve.model.hardware import resolve_dtype
    from vlserve.model.hf_config import load_model_config

    args.dtype = str(resolve_dtype(args.dtype, load_model_config(model).checkpoint_dtype,
                                   torch.device("cpu"))).removeprefix("torch.")
    print(f"dtype: {args.dtype}")
    results = {}
    port = free_port()
    results["vlserve"] = run_one(
        "vlserve", [sys.executable, "-m", "vlserve", "serve", "--model", model, "--dtype", args.dtype, "--port",
                    str(port), "--max-model-len", "4096", "--disable-log-requests"],
        {**os.environ}, port, bench, 300)
    if args.vllm_venv:
        port = free_port()
        results["vLLM-CPU"] = run_one(
            "vLLM-CPU", [str(args.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                         model, "--dtype", args.dtype, "--port",
                         str(port), "--max-model-len", "4096"],
            vllm_env(args.vllm_venv), port, bench, 600)

    names = list(results)
    print(f"\n{'metric':<18}" + "".join(f"{n:>14}" for n in names) + ("   vlserve/vLLM" if len(names) > 1 else ""))
    for key, label, better in ROWS:
        vals = [results[n].get(key) for n in names]
        line = f"{label:<18}" + "".join(f"{v:>14.1f}" if v is not None else f"{'-':>14}" for v in vals)
        if len(names) > 1 and vals[0] and vals[1]:
            line += f"   {vals[0] / vals[1]:.2f}x ({'higher' if better > 0 else 'lower'} is better)"
        print(line)


if __name__ == "__main__":
    main()
