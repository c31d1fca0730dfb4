"""Cache-aware routing vs round-robin vs least-load, same run: multi-turn chats with pictures over 2 replicas.

Starts a bootstrap registry, two `vlserve serve --registry ... --kv-events-endpoint ...` replicas and one
`vlserve router` per policy in front of the same replicas. Each policy gets the same workload shape with its own
pictures (so no policy inherits another's cache): `--users` users chat concurrently, each `--turns` turns about
their own picture, every turn resending the conversation so far. Reported per policy: prefix-cache hit rate over
both replicas (hit tokens / queried tokens, from their /metrics), TTFT p50/p99 (first streamed content chunk,
at the client), requests/s; then each policy's ratio to round-robin.

On a 2-core machine both replicas share the cores: the TTFT difference is what the prefill and vision work a
cache hit saves, not added compute.

    .venv/bin/python benchmarks/routing.py [--model DIR] [--users 6] [--turns 4] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import noise_image  # noqa: E402
from tests.server_utils import free_port, scrape, start_vlserve, stop, wait_healthy  # noqa: E402

POLICIES = ("round-robin", "least-load", "cache-aware")
SYSTEM = "You are a careful assistant who answers questions about the user's picture. " * 3
QUESTIONS = ["What is in this picture?", "What colours stand out?", "Is there any text?", "Describe the corners.",
             "What might it be used for?", "Summarise our chat."]


def data_url(seed: int, side: int) -> str:
    buf = io.BytesIO()
    noise_image(side, side, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start(name: str, args: list[str], health: str, logs: list) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"vlserve-{name}-", suffix=".log", delete=False)
    logs.append(log)
    proc = start_vlserve(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.health, proc.name, proc.log_path = health, name, log.name
    return proc


async def one_user(client: httpx.AsyncClient, url: str, model: str, seed: int, turns: int, side: int,
                   max_tokens: int, ttfts: list[float]) -> int:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed, side)}},
                                             {"type": "text", "text": QUESTIONS[0]}]}]
    done = 0
    for turn in range(turns):
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        first, text = None, []
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
        ttfts.append((first or time.perf_counter()) - t0)
        done += 1
        messages = [*messages, {"role": "assistant", "content": "".join(text)},
                    {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
        await asyncio.sleep(0.05)  # a user reads the answer; the replica's cache events reach the router
    return done


def cache_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        for k, v in scrape(f"{u}/metrics").items():
            hits += v if k.startswith("vlserve:prefix_cache_hits_total") else 0
            queries += v if k.startswith("vlserve:prefix_cache_queries_total") else 0
    return hits, queries


async def run_policy(url: str, replicas: list[str], model: str, seed0: int, a) -> dict:
    h0, q0 = cache_counts(replicas)
    ttfts: list[float] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        done = await asyncio.gather(*(one_user(client, url, model, seed0 + u, a.turns, a.image_side, a.max_tokens,
                                               ttfts) for u in range(a.users)))
    elapsed = time.perf_counter() - t0
    h1, q1 = cache_counts(replicas)
    ttfts.sort()
    return {"hit_rate": (h1 - h0) / max(q1 - q0, 1), "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "req_s": sum(done) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a random Qwen2-VL of --size made in a temp dir)")
    ap.add_argument("--size", default="medium", help="size of the random checkpoint made without --model")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--image-side", type=int, default=448, help="picture width and height in pixels")
    a = ap.parse_args()
    model = a.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / a.size, arch="qwen2_vl", size=a.size))
    logs: list = []
    procs: list[subprocess.Popen] = []
    bport = free_port()
    hb = ["--heartbeat-interval", "0.5"]
    try:
        procs.append(start("bootstrap", ["bootstrap", "--port", str(bport), *hb],
                           f"http://127.0.0.1:{bport}/health", logs))
        replicas = []
        for i in range(2):
            port = free_port()
            replicas.append(f"http://127.0.0.1:{port}")
            procs.append(start(f"replica-{i}", ["serve", "--model", model, "--port", str(port), "--registry",
                                                f"http://127.0.0.1:{bport}", "--kv-events-endpoint",
                                                f"tcp://127.0.0.1:{free_port()}", *hb], f"{replicas[-1]}/health",
                               logs))
        routers = {}
        for policy in POLICIES:
            port = free_port()
            routers[policy] = f"http://127.0.0.1:{port}"
            procs.append(start(f"router-{policy}", ["router", "--model", model, "--port", str(port), "--bootstrap",
                                                    f"127.0.0.1:{bport}", "--routing", policy, *hb],
                               f"{routers[policy]}/ready", logs))
        for p in procs:
            wait_healthy(p, p.health, 300, p.name, lambda p=p: Path(p.log_path).read_text())
        time.sleep(3)  # routers follow every replica's event stream in order (not cold)
        name = httpx.get(f"{replicas[0]}/v1/models").json()["data"][0]["id"]
        results = {}
        for k, policy in enumerate(POLICIES):
            results[policy] = asyncio.run(run_policy(routers[policy], replicas, name, 1000 * (k + 1), a))
    finally:
        for p in reversed(procs):
            stop(p)
        for log in logs:
            log.close()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = open("/proc/cpuinfo").read()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "neither AVX2 nor AVX-512"
    print(f"machine: {cpu} ({isa}), {os.cpu_count()} cores; 2 replicas; {a.users} users x {a.turns} turns, "
          f"{a.image_side}px pictures, {a.max_tokens} tokens per answer")
    base = results["round-robin"]
    print(f"{'policy':<12} {'hit rate':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'req/s':>7}   "
          "(x round-robin: hit rate, TTFT p50, req/s)")
    for policy, r in results.items():
        print(f"{policy:<12} {r['hit_rate']:>9.1%} {r['ttft_p50'] * 1e3:>12.0f} {r['ttft_p99'] * 1e3:>12.0f} "
              f"{r['req_s']:>7.2f}   x{r['hit_rate'] / max(base['hit_rate'], 1e-9):.2f} "
              f"x{r['ttft_p50'] / base['ttft_p50']:.2f} x{r['req_s'] / base['req_s']:.2f}")


if __name__ == "__main__":
    main()
