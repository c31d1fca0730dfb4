"""The server's own CPU a streamed token (the front-end process: SSE chunks through uvicorn, detokenizing, the
engine's outputs), with each HTTP parser and event loop, side by side in one run: h11 on asyncio's loop (what
vlserve ran before) against httptools on uvloop (what it picks where they are installed, core/http_protocol.py).
On a machine with few cores that CPU is taken from the engine's threads, so it shows in TPOT at concurrency 1.

Each round starts a server per setting (the small random Qwen2-VL by default, text prompts, 64 output tokens,
concurrency 1, vlserve's own client) and reads the front end's CPU time from /proc before and after the load;
rounds alternate the settings (the machines are noisy). Prints medians over rounds and the ratios.

    .venv/bin/python benchmarks/front_end_cpu.py [--model small|medium|DIR] [--rounds 3] [--prompts 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server_utils import free_port, start_vlserve, stop, wait_healthy  # noqa: E402
from vlserve.core.http_protocol import LOOP_ENV, PARSER_ENV  # noqa: E402

SETTINGS = {"h11 + asyncio (before)": ("h11", "asyncio"), "httptools + uvloop": ("httptools", "uvloop")}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system time of the process (all its threads), not of its children (the engine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def bench(port: int, prompts: int, result: Path) -> dict:
    subprocess.run([sys.executable, "-m", "vlserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                    "--num-prompts", str(prompts), "--input-len", "48", "--output-len", "64",
                    "--images-per-request", "0", "--ignore-eos", "--max-concurrency", "1", "--disable-tqdm",
                    "--result-file", str(result)], check=True, capture_output=True)
    return json.loads(result.read_text())["metrics"]


def one_round(model: str, parser: str, loop: str, prompts: int, extra: list[str], work: Path) -> dict:
    port = free_port()
    log = open(work / f"server-{parser}-{loop}.log", "w")
    env = {**os.environ, PARSER_ENV: parser, LOOP_ENV: loop}
    proc = start_vlserve(["serve", "--model", model, "--port", str(port), "--disable-log-requests", *extra],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", 300, "server", lambda: Path(log.name).read_text())
        bench(port, 2, work / "warm.json")
        before = cpu_seconds(proc.pid)
        m = bench(port, prompts, work / "run.json")
        spent = cpu_seconds(proc.pid) - before
        return {"cpu_ms_per_token": 1000 * spent / m["total_output_tokens"], "tpot_ms": m["median_tpot_ms"],
                "output_tok_s": m["output_throughput"]}
    finally:
        stop(proc)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="small, medium or a checkpoint folder (default: small)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=40, help="requests of 64 tokens per measurement")
    ap.add_argument("--server-args", default="--dtype float32", help="more `vlserve serve` flags")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="front-end-cpu-"))
    model = args.model
    if model in ("small", "medium"):
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / model, arch="qwen2_vl", size=model, seed=0))
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, (parser, loop) in SETTINGS.items():
            results[name].append(one_round(model, parser, loop, args.prompts, args.server_args.split(), work))
            print(f"round {r + 1} {name}: {results[name][-1]}", flush=True)
    print(f"\n{args.model}, concurrency 1, 64 output tokens, {args.prompts} requests, medians of {args.rounds} "
          f"rounds, {os.cpu_count()} CPUs")
    base, new = SETTINGS
    print(f"{'':<34}{base:>24}{new:>22}{'ratio':>8}")
    for key, label in (("cpu_ms_per_token", "front-end CPU ms a token"), ("tpot_ms", "TPOT median ms"),
                       ("output_tok_s", "output tok/s")):
        a = statistics.median(x[key] for x in results[base])
        b = statistics.median(x[key] for x in results[new])
        print(f"{label:<34}{a:>24.3f}{b:>22.3f}{b / a:>7.2f}x")


if __name__ == "__main__":
    main()
