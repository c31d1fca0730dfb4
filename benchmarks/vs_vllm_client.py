"""vlserve against vLLM-CPU, both driven by vLLM's own benchmark client (`vllm bench serve`, `random-mm`), in one
run: each server started fresh on the same checkpoint, the same seeded requests (one 336x336 picture + 48 prompt
tokens, 48 output tokens, ignore_eos), a short warm-up with other pictures first; then a table of both and the
ratios, beside this machine's memory-bandwidth bound for batch-1 decode.

    .venv/bin/python benchmarks/vs_vllm_client.py --vllm-venv /path/peer/venv [--runs small:1,small:8,medium:8]

A run is MODEL:CONCURRENCY with MODEL `small` (the demo checkpoint's size) or `medium` (~230M parameters), both
random Qwen2-VL made here, or a checkpoint folder. vLLM-CPU set-up: ../shared/peers/README.md (setup_venv.sh DIR;
the client runs in that venv, whose `vllm` console script does not start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_bounds import decode_bytes_per_token, read_bandwidth  # noqa: E402
from online_serving import stop_server, vllm_env, wait_healthy  # noqa: E402

from tests.server_utils import free_port  # noqa: E402

ROWS = [("output_throughput", "output tok/s", 1), ("median_ttft_ms", "TTFT median ms", -1),
        ("p99_ttft_ms", "TTFT p99 ms", -1), ("median_tpot_ms", "TPOT median ms", -1),
        ("median_itl_ms", "ITL median ms", -1)]
# vLLM's client, from Python: the venv's `vllm` console script fails at start (package metadata lookup).
CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; "
          "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def client_args(port: int, model: str, concurrency: int, num_prompts: int, pictures: int, seed: int,
                result: Path) -> list[str]:
    return ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url",
            f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model, "--dataset-name", "random-mm",
            "--random-input-len", "48", "--random-output-len", "48", "--random-range-ratio", "0",
            "--random-mm-base-items-per-request", str(pictures), "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", f'{{"image": {pictures}, "video": 0}}',
            "--random-mm-bucket-config", "{(336, 336, 1): 1.0}", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


@dataclass(frozen=True)
class Load:
    concurrency: int
    prompts: int
    pictures: int = 1
    hogs: int = 0  # busy processes beside the server while this load runs (a shared or throttled machine)

    @property
    def tag(self) -> str:
        return f"c{self.concurrency}-p{self.pictures}-h{self.hogs}"


@contextlib.contextmanager
def cpu_hogs(count: int):
    """`count` processes that spin on the CPU for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def measure(name: str, server_cmd: list[str], server_env: dict | None, port: int, venv: Path, model: str,
            loads: list[Load]) -> list[dict]:
    """Starts the server, warms it up, runs each load with vLLM's client, stops it."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    print(f"[{name}] starting (log: {log.name})", flush=True)
    proc = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env)
    out_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-client-"))
    results = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 900)
        client_env = vllm_env(venv)
        client_env.pop("LD_PRELOAD", None)
        for seed, load in enumerate([Load(2, 4), *loads]):  # fresh pictures in every load: no cache hits
            result = out_dir / f"{seed}-{load.tag}.json"
            print(f"[{name}] {'warm-up' if seed == 0 else load.tag}: {load.prompts} requests", flush=True)
            with cpu_hogs(load.hogs):
                subprocess.run([str(venv / "bin" / "python"), "-c", CLIENT,
                                *client_args(port, model, load.concurrency, load.prompts, load.pictures, 1000 + seed,
                                             result)],
                               check=True, stdout=log, stderr=log, env=client_env)  # the client's noise: in the log
            if seed:
                results.append(json.loads(result.read_text()))
        return results
    finally:
        stop_server(proc)


def both(model: str, venv: Path, loads: list[Load]) -> tuple[list[dict], list[dict]]:
    """vlserve's results, then vLLM-CPU's, for the same loads on the same checkpoint (fp32 on both sides)."""
    most = max(load.pictures for load in loads)
    port = free_port()
    ours = measure("vlserve", [sys.executable, "-m", "vlserve", "serve", "--model", model, "--dtype", "float32",
                               "--port", str(port), "--max-model-len", "4096", "--disable-log-requests",
                               "--limit-mm-per-prompt", f"image={most}"], None, port, venv, model, loads)
    port = free_port()
    peer = measure("vLLM-CPU", [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                                "--model", model, "--dtype", "float32", "--port", str(port), "--max-model-len",
                                "4096", "--limit-mm-per-prompt", f'{{"image": {most}, "video": 0}}'],
                   vllm_env(venv), port, venv, model, loads)
    return ours, peer


def checkpoint(spec: str, folder: Path) -> str:
    if spec not in ("small", "medium"):
        return spec
    from vlserve.tools.tiny_model import make_tiny_model

    return str(make_tiny_model(folder / spec, arch="qwen2_vl", size=spec, seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", type=Path, required=True, help="DIR/venv of ../shared/peers/vllm_cpu/setup_venv.sh")
    ap.add_argument("--runs", default="small:1,small:8,medium:8",
                    help="MODEL:CONCURRENCY[:PICTURES],... (PICTURES per request, default 1; default: %(default)s)")
    ap.add_argument("--prompts-per-concurrency", type=int, default=4, help="prompts = this x concurrency (min 16)")
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="vs-vllm-models-"))
    by_model: dict[str, list[tuple[int, int]]] = {}
    for run in args.runs.split(","):
        spec, *numbers = run.split(":")
        concurrency, pictures = int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 1
        by_model.setdefault(spec, []).append((concurrency, pictures))
    bandwidth = read_bandwidth()
    print(f"{torch.get_num_threads()} threads; memory read {bandwidth / 1e9:.1f} GB/s; fp32 on both sides")
    table = []
    for spec, runs in by_model.items():
        model = checkpoint(spec, folder)
        loads = [Load(c, max(16, args.prompts_per_concurrency * c), k) for c, k in runs]
        ours, peer = both(model, args.vllm_venv, loads)
        bound = bandwidth / decode_bytes_per_token(model, 4, 4)  # fp32 weights read once per batch-1 token
        for load, a, b in zip(loads, ours, peer):
            table.append((spec, load.concurrency, load.pictures, a, b, bound))

    for spec, concurrency, pictures, a, b, bound in table:
        print(f"\n{spec} model, concurrency {concurrency}, {pictures} picture(s) a request "
              f"(batch-1 decode bound {bound:.0f} tok/s)")
        print_rows(a, b, "vLLM-CPU")


def print_rows(ours: dict, peer: dict, peer_name: str) -> None:
    """vLLM's client's figures for vlserve and a peer, side by side with their ratio."""
    print(f"{'metric':<16}{'vlserve':>10}{peer_name:>11}   vlserve/{peer_name}")
    for key, label, better in ROWS:
        x, y = ours.get(key), peer.get(key)
        ratio = f"{x / y:.2f}x ({'higher' if better > 0 else 'lower'} is better)" if x and y else "-"
        print(f"{label:<16}{x or 0:>10.1f}{y or 0:>11.1f}   {ratio}")


if __name__ == "__main__":
    main()
