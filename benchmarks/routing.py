"""Cache-aware routing vs round-robin vs least-load, same run: multi-turn chats with pictures over 2 replicas.

Starts a bootstrap registry, two `vlserve serve --registry ... --kv-events-endpoint ...` replicas and one
`vlserve router` per policy in front of the same replicas. Each policy gets the same workload shape with its own
pictures and its own system prompt (so no policy inherits another's cache, and the shared prompt starts cached
nowhere, as on a fresh deployment): `--users` users chat, each `--turns` turns about their own picture, every
turn resending the conversation so far, at most `--concurrency` requests at once (1: the users take turns, one
request at a time, nothing ever in flight when the router chooses; a list runs each level). Reported per policy:
prefix-cache hit rate over both replicas (hit tokens / queried tokens, from their /metrics), TTFT p50/p99 (first
streamed content chunk, at the client), requests/s, requests per replica; then each policy's ratio to
round-robin.

Cache pressure: a router matters when caches are full. Each replica's KV cache (`--num-kv-blocks`) is sized from
the workload: `--cache-share` (default 0.6) of the working set, the blocks of every user's last prompt. So the
conversations fit in the two caches when each is cached once (on one replica), not when each is cached on both,
which is what round-robin and least-load do after a few turns. `--cache-share 4` gives caches that never evict.

Warm-up first (each replica and router serves a few requests of its own, outside the measurement), and the
machine's bounds: TTFT of an idle replica for a picture turn not cached vs fully cached (what a hit can save at
best here), and the hit rate if every turn found the previous turn of its chat cached.

    .venv/bin/python benchmarks/routing.py [--model DIR | --size medium] [--users 8] [--turns 4] [--cache-share 0.75]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
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
BLOCK = 16
SYSTEM = "You are a careful assistant who answers questions about the user's picture. " * 3
QUESTIONS = ["What is in this picture?", "What colours stand out?", "Is there any text?", "Describe the corners.",
             "What might it be used for?", "Summarise our chat."]


def data_url(seed: int, side: int) -> str:
    buf = io.BytesIO()
    noise_image(side, side, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def system_prompt(run: int) -> str:
    """Every chat of one run shares it (as a deployment's chats share a template and a system prompt); each run
    has its own, so that no replica holds it when the run starts: which replica caches it first is up to the
    policy, as on a fresh deployment."""
    return f"Session {run}. {SYSTEM}"


def first_turn(seed: int, side: int, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed, side)}},
                                         {"type": "text", "text": QUESTIONS[0]}]}]


def next_turn(messages: list[dict], answer: str, turn: int) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]


def last_prompt_blocks(model: str, a) -> int:
    """Blocks of a user's last prompt (the layout the router computes; answers as `max_tokens` words)."""
    from vlserve.core.config import EngineArgs
    from vlserve.engine.config import resolve_config
    from vlserve.frontend.chat import parse_chat_messages
    from vlserve.frontend.input_processor import InputProcessor
    from vlserve.frontend.tokenizer import render_chat

    proc = InputProcessor.for_model(resolve_config(EngineArgs(model=model, dtype="float32"), announce=False))
    messages = first_turn(0, a.image_side)
    for turn in range(a.turns - 1):
        messages = next_turn(messages, " ".join(["word"] * a.max_tokens), turn)
    chat = parse_chat_messages(messages, allow_python_objects=False, modalities=proc.modalities)
    return math.ceil(proc.layout(chat.prompt(render_chat(proc.tokenizer, chat.messages, True))).num_tokens / BLOCK)


def start(name: str, args: list[str], health: str, logs: list) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"vlserve-{name}-", suffix=".log", delete=False)
    logs.append(log)
    proc = start_vlserve(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.health, proc.name, proc.log_path = health, name, log.name
    return proc


async def ask(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed turn: TTFT (first content chunk), the answer, and the usage the replica reports."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                first = first or time.perf_counter()
                text.append(delta)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft": (first or time.perf_counter()) - t0, "answer": "".join(text),
            "prompt": usage.get("prompt_tokens", 0), "cached": cached}


async def one_user(client: httpx.AsyncClient, url: str, model: str, seed: int, a, turns: list[dict],
                   slots: asyncio.Semaphore) -> None:
    messages = first_turn(seed, a.image_side, system_prompt(seed // 1000))
    for turn in range(a.turns):
        async with slots:  # FIFO: at concurrency 1 the users take turns
            turns.append({**await ask(client, url, model, messages, a.max_tokens), "turn": turn, "user": seed})
        messages = next_turn(messages, turns[-1]["answer"], turn)
        await asyncio.sleep(0.05)  # a user reads the answer; the replica's cache events reach the router


def cpu_seconds(groups: list[int]) -> float:
    """CPU time (user + system) of every live process in these process groups (each vlserve process and its
    engine): what a policy costs the machine, not only how long its clients waited."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups:  # pgrp
            total += int(fields[11]) + int(fields[12])
    return total / tick


def cache_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        for k, v in scrape(f"{u}/metrics").items():
            hits += v if k.startswith("vlserve:prefix_cache_hits_total") else 0
            queries += v if k.startswith("vlserve:prefix_cache_queries_total") else 0
    return hits, queries


def routed_per_replica(url: str) -> dict[str, tuple[float, float]]:
    """Requests the router sent to each replica so far: (all, decided by a cached prefix)."""
    out: dict[str, tuple[float, float]] = {}
    for k, v in scrape(f"{url}/metrics").items():
        if k.startswith("vlserve:router_requests_total"):
            replica = k.split('replica="', 1)[1].split('"', 1)[0]
            total, by_cache = out.get(replica, (0.0, 0.0))
            out[replica] = (total + v, by_cache + (v if 'decision="cache-hit"' in k else 0))
    return out


async def run_policy(url: str, replicas: list[str], model: str, seed0: int, a, groups: list[int],
                     router: int, concurrency: int) -> dict:
    h0, q0 = cache_counts(replicas)
    before = routed_per_replica(url)
    c0, r0 = cpu_seconds(groups), cpu_seconds([router])
    turns: list[dict] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        slots = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(one_user(client, url, model, seed0 + u, a, turns, slots) for u in range(a.users)))
    elapsed = time.perf_counter() - t0
    h1, q1 = cache_counts(replicas)
    cpu, router_cpu = cpu_seconds(groups) - c0, cpu_seconds([router]) - r0
    after = routed_per_replica(url)
    counts = [after[n][0] - before.get(n, (0, 0))[0] for n in after]
    split = sorted(counts + [0.0] * (len(replicas) - len(counts)), reverse=True)  # a replica sent nothing: 0
    by_cache = sum(after[n][1] - before.get(n, (0, 0))[1] for n in after)
    ttfts = sorted(t["ttft"] for t in turns)
    return {"hit_rate": (h1 - h0) / max(q1 - q0, 1), "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "req_s": len(turns) / elapsed,
            "cpu_per_req": cpu / len(turns), "router_cpu_per_req": router_cpu / len(turns), "turns": turns,
            "split": "/".join(f"{v:.0f}" for v in split), "by_cache": by_cache}


def hit_bound(turns: list[dict]) -> float:
    """Every turn finds the previous turn's prompt cached (whole blocks), a first turn its system prompt (the
    least any first turn found: the system prompt is cached everywhere after the warm-up)."""
    prompt = {(t["user"], t["turn"]): t["prompt"] for t in turns}
    system = min(t["cached"] for t in turns if t["turn"] == 0)
    cacheable = sum(prompt[u, k - 1] // BLOCK * BLOCK if k else system for u, k in prompt)
    return cacheable / sum(prompt.values())


async def idle_ttft(url: str, model: str, a) -> tuple[float, float]:
    """An idle replica's TTFT for a picture turn: not cached (new picture), then the same again (cached)."""
    cold, warm = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for seed in range(3):
            messages = first_turn(900 + seed, a.image_side)
            cold.append((await ask(client, url, model, messages, a.max_tokens))["ttft"])
            await asyncio.sleep(0.2)
            warm.append((await ask(client, url, model, messages, a.max_tokens))["ttft"])
    return statistics.median(cold), statistics.median(warm)


async def warm_up(urls: list[str], model: str, a) -> None:
    """Start-up costs out of the measurement: pictures through each replica, text through each router."""
    async with httpx.AsyncClient(timeout=600) as client:
        for k, url in enumerate(urls):
            messages = first_turn(800 + k, a.image_side) if k < 2 else [{"role": "system", "content": SYSTEM},
                                                                         {"role": "user", "content": "Hello."}]
            for _ in range(2):
                await ask(client, url, model, messages, a.max_tokens)


def wait_following(routers: list[str], timeout: float = 60) -> None:
    """Every router follows both replicas' event streams from their start (a router that joins a stream late
    never learns what was stored before: it is cold until then)."""
    deadline = time.monotonic() + timeout
    for url in routers:
        while True:
            m = scrape(f"{url}/metrics")
            if (m.get('vlserve:router_replicas{state="answering"}') == 2
                    and m.get('vlserve:router_replicas{state="cache_cold"}') == 0):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {url} does not follow both replicas: {m}")
            time.sleep(0.2)


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = open("/proc/cpuinfo").read()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "neither AVX2 nor AVX-512"
    return f"{cpu} ({isa}), {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a random Qwen2-VL of --size made in a temp dir)")
    ap.add_argument("--size", default="medium", help="size of the random checkpoint made without --model")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", default="8", help="most requests at once, or a comma list to run each (1: the "
                    "users take turns)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--image-side", type=int, default=448, help="picture width and height in pixels")
    ap.add_argument("--cache-share", type=float, default=0.6,
                    help="each replica's KV cache, as a share of the working set (all users' last prompts)")
    ap.add_argument("--num-kv-blocks", type=int, help="each replica's KV cache in blocks (instead of --cache-share)")
    ap.add_argument("--routing-cache-weight", type=float, default=1.0)
    a = ap.parse_args()
    model = a.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / a.size, arch="qwen2_vl", size=a.size))
    per_user = last_prompt_blocks(model, a)
    working_set = a.users * per_user
    kv_blocks = a.num_kv_blocks or max(2 * per_user, math.ceil(a.cache_share * working_set))
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
            procs.append(start(f"replica-{i}", [
                "serve", "--model", model, "--port", str(port), "--registry", f"http://127.0.0.1:{bport}",
                "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", "--num-kv-blocks", str(kv_blocks),
                "--block-size", str(BLOCK), *hb], f"{replicas[-1]}/health", logs))
        routers = {}
        for policy in POLICIES:
            port = free_port()
            routers[policy] = f"http://127.0.0.1:{port}"
            procs.append(start(f"router-{policy}", [
                "router", "--model", model, "--port", str(port), "--bootstrap", f"127.0.0.1:{bport}", "--routing",
                policy, "--block-size", str(BLOCK), "--routing-cache-weight", str(a.routing_cache_weight), *hb,
                "--allow-unsigned-replicas"],  # its own loopback bootstrap, no secret
                f"{routers[policy]}/ready", logs))
        for p in procs:
            wait_healthy(p, p.health, 300, p.name, lambda p=p: Path(p.log_path).read_text())
        name = httpx.get(f"{replicas[0]}/v1/models").json()["data"][0]["id"]
        wait_following(list(routers.values()))
        asyncio.run(warm_up([*replicas, *routers.values()], name, a))
        cold, warm = asyncio.run(idle_ttft(replicas[0], name, a))
        time.sleep(3)  # routers follow every replica's event stream in order (not cold)
        runs: dict[int, dict[str, dict]] = {}
        groups = [p.pid for p in procs if p.name.startswith("replica")]
        for c, concurrency in enumerate(int(x) for x in a.concurrency.split(",")):
            runs[concurrency] = {}
            for k, policy in enumerate(POLICIES):  # new pictures for every run: no run inherits another's cache
                router = next(p.pid for p in procs if p.name == f"router-{policy}")
                runs[concurrency][policy] = asyncio.run(run_policy(
                    routers[policy], replicas, name, 10_000 * (c + 1) + 1000 * (k + 1), a, groups, router,
                    concurrency))
    finally:
        for p in reversed(procs):
            stop(p)
        for log in logs:
            log.close()
    print(f"machine: {machine()}; 2 replicas; {a.users} users x {a.turns} turns, {a.image_side}px pictures, "
          f"{a.max_tokens} tokens per answer; model {Path(model).name}")
    print(f"KV cache per replica: {kv_blocks} blocks of {BLOCK} = {kv_blocks / working_set:.2f} x the working set "
          f"({a.users} users x {per_user} blocks); --routing-cache-weight {a.routing_cache_weight}")
    print(f"bounds: idle replica TTFT {cold * 1e3:.0f} ms not cached, {warm * 1e3:.0f} ms cached")
    for concurrency, results in runs.items():
        report(concurrency, results)
    if len(runs) > 1:
        print("\nsummary: hit rate round-robin / least-load / cache-aware (bound); cache-aware requests per replica")
        for concurrency, results in runs.items():
            rates = " / ".join(f"{results[p]['hit_rate']:.1%}" for p in POLICIES)
            print(f"concurrency {concurrency}: {rates} ({hit_bound(results['cache-aware']['turns']):.1%}); "
                  f"{results['cache-aware']['split']}")


def report(concurrency: int, results: dict[str, dict]) -> None:
    print(f"\nconcurrency {concurrency}: hit rate if every turn found its chat's previous turn cached: "
          f"{hit_bound(results['cache-aware']['turns']):.1%}")
    base = results["round-robin"]
    print(f"{'policy':<12} {'hit rate':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'req/s':>7} {'CPU ms/req':>11}"
          f" {'per replica':>12}   (x round-robin: hit rate, TTFT p50, req/s)")
    for policy, r in results.items():
        print(f"{policy:<12} {r['hit_rate']:>9.1%} {r['ttft_p50'] * 1e3:>12.0f} {r['ttft_p99'] * 1e3:>12.0f} "
              f"{r['req_s']:>7.2f} {r['cpu_per_req'] * 1e3:>11.0f} {r['split']:>12}   "
              f"x{r['hit_rate'] / max(base['hit_rate'], 1e-9):.2f} x{r['ttft_p50'] / base['ttft_p50']:.2f} "
              f"x{r['req_s'] / base['req_s']:.2f}")
    print("CPU ms/req: both replicas'; routers' own: " + ", ".join(
        f"{p} {r['router_cpu_per_req'] * 1e3:.0f}" for p, r in results.items()) +
        f"; cache-aware decided by a cached prefix: {results['cache-aware']['by_cache']:.0f} requests")


if __name__ == "__main__":
    main()
