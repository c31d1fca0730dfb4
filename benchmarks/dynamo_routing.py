"""Dynamo's KV router vs round-robin in front of two vlserve workers, same run: multi-turn chats with pictures.

Starts etcd, NATS, two `vlserve dynamo-worker` processes and two Dynamo frontends on the same workers, one with
`--router-mode kv` (fed by the workers' KV events) and one with `--router-mode round-robin`. Each policy gets the
same workload shape with its own pictures and system prompt (no policy inherits another's cache): `--users` users
chat `--turns` turns about their own picture, each turn resending the conversation so far, `--concurrency` users
at once. Reported per policy: the workers' prefix-cache hit rate (hit tokens / looked-up tokens, from vlserve's
counters on the workers' /metrics), TTFT p50 (first streamed content, at the client) and requests per worker; the
reference beside it ("prev turn"): the hit rate if every turn found its own previous turn cached (the system
prompt and text that users share can add to it). With `--kill-after S`, a failover run follows: one worker killed
S seconds into a load through the kv frontend.

    .venv/bin/python benchmarks/dynamo_routing.py [--model DIR | --arch qwen2_vl --size small] [--users 6]

Needs `make install-dynamo` (and etcd, which `make install` brings).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from vlserve.core.processes import die_with_parent, free_port


def data_url(seed: int, side: int = 224) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=die_with_parent)


def counters(system_ports: list[int]) -> tuple[float, float]:
    hits = queries = 0.0
    for port in system_ports:
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            if line.startswith("vlserve:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vlserve:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def ask(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "nvext": {"extra_fields": ["worker_id"]}}
    text, ttft, usage, worker = "", None, None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                if c["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    text += c["delta"]["content"]
            usage = chunk.get("usage") or usage
            worker = ((chunk.get("nvext") or {}).get("worker_id") or {}).get("decode_worker_id", worker)
    return {"text": text, "ttft": ttft or time.perf_counter() - t0, "prompt_tokens": usage["prompt_tokens"],
            "worker": worker}


async def one_user(client, url: str, seed: int, system: str, a, out: list) -> None:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed)}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    previous = 0
    for turn in range(a.turns):
        r = await ask(client, url, messages, a.max_tokens)
        out.append({**r, "previous": previous})
        previous = r["prompt_tokens"]
        messages += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": f"Tell me more about it (turn {turn + 2})."}]


async def failover(url: str, victim: subprocess.Popen, a) -> None:
    """Load through the kv frontend; SIGKILL one worker (and its engine) `--kill-after` seconds in: how many
    requests fail, and how long the slowest one took, before and after."""
    log: list[tuple[float, float, str]] = []
    killed_at: list[float] = []
    sem = asyncio.Semaphore(4)
    body = lambda i: {"model": "m", "max_tokens": a.max_tokens, "temperature": 0, "messages": [  # noqa: E731
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(5000 + i % 8)}},
                                     {"type": "text", "text": "Describe it."}]}]}

    async with httpx.AsyncClient() as client:
        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    r = await client.post(url + "/v1/chat/completions", json=body(i), timeout=a.client_timeout)
                    status = str(r.status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                log.append((t0, time.perf_counter() - t0, status))

        async def kill() -> None:
            await asyncio.sleep(a.kill_after)
            os.killpg(victim.pid, 9)
            killed_at.append(time.perf_counter())

        killer = asyncio.create_task(kill())
        deadline = time.perf_counter() + a.kill_after * 3
        i = 0
        while time.perf_counter() < deadline:
            await asyncio.gather(*(one(i + k) for k in range(8)))
            i += 8
        await killer
    after = [r for r in log if r[0] >= killed_at[0]]
    for name, part in (("before the kill", [r for r in log if r[0] < killed_at[0]]), ("after the kill", after)):
        failed = [r for r in part if r[2] != "200"]
        print(f"failover, {name}: {len(part)} requests, {len(failed)} failed "
              f"({', '.join(sorted(set(r[2] for r in failed))) or '-'}), slowest {max(r[1] for r in part):.2f}s "
              f"(client timeout {a.client_timeout:g}s)")


async def run_policy(url: str, seed0: int, system: str, a) -> list[dict]:
    out: list[dict] = []
    sem = asyncio.Semaphore(a.concurrency)
    async with httpx.AsyncClient() as client:
        async def user(i: int):
            async with sem:
                await one_user(client, url, seed0 + i, system, a, out)
        await asyncio.gather(*(user(i) for i in range(a.users)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: a random one of --arch/--size made here)")
    p.add_argument("--arch", default="qwen2_vl")
    p.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kill-after", type=float, default=0.0,
                   help="then a failover run: SIGKILL one worker this many seconds into a load (0: none)")
    p.add_argument("--client-timeout", type=float, default=60.0)
    p.add_argument("--router-event-threads", type=int, default=None,
                   help="the kv frontend's --router-event-threads (default: Dynamo's)")
    a = p.parse_args()
    for binary in ("etcd", "nats-server"):
        if shutil.which(binary) is None:
            sys.exit(f"{binary} is missing: `make install` / `make install-dynamo` install it where they can")
    tmp = Path(tempfile.mkdtemp(prefix="vlserve-dynamo-bench-"))
    model = a.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(tmp / "model", arch=a.arch, size=a.size))
    etcd_port, nats_port = free_port(), free_port()
    env = {**os.environ, "ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}", "NATS_SERVER": f"nats://127.0.0.1:{nats_port}",
           "DYN_NAMESPACE": "bench", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
           "DYN_EVENT_PLANE_HOST": "127.0.0.1", "HOME": str(tmp), "OMP_NUM_THREADS": "1"}
    peer = free_port()
    procs = [start(["etcd", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", env["ETCD_ENDPOINTS"],
                    "--advertise-client-urls", env["ETCD_ENDPOINTS"], "--listen-peer-urls",
                    f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-cluster", f"default=http://127.0.0.1:{peer}", "--log-level", "warn"], env,
                   tmp / "etcd.log"),
             start(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(nats_port), "--store_dir", str(tmp / "nats")],
                   env, tmp / "nats.log")]
    time.sleep(2)
    system_ports = [free_port(), free_port()]
    workers = [start([sys.executable, "-m", "vlserve", "dynamo-worker", "--model", model, "--served-model-name",
                      "m", "--cpu-threads", "1"], {**env, "DYN_SYSTEM_PORT": str(port)}, tmp / f"worker{i}.log")
               for i, port in enumerate(system_ports)]
    policies = {"round-robin": free_port(), "kv": free_port()}
    threads = ([] if a.router_event_threads is None else ["--router-event-threads", str(a.router_event_threads)])
    frontends = [start([sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                        str(port), "--router-mode", mode, *(threads if mode == "kv" else [])], env,
                       tmp / f"frontend-{mode}.log") for mode, port in policies.items()]
    procs += workers + frontends
    try:
        deadline = time.monotonic() + 300
        while not all(re.search("ready for Dynamo", (tmp / f"worker{i}.log").read_text(errors="replace"))
                      for i in range(2)):
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                sys.exit(f"the workers did not start: see {tmp}")
            time.sleep(1)
        for port in policies.values():
            while '"m"' not in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).text:
                time.sleep(0.5)
        print(f"model {model}; {a.users} users x {a.turns} turns, concurrency {a.concurrency}, 2 workers "
              f"(1 core each); machine: {os.cpu_count()} cores")
        rows = {}
        for k, (mode, port) in enumerate(policies.items()):
            h0, q0 = counters(system_ports)
            results = asyncio.run(run_policy(f"http://127.0.0.1:{port}", 1000 * (k + 1),
                                             f"You are assistant number {k}.", a))
            h1, q1 = counters(system_ports)
            bound = sum(r["previous"] for r in results) / sum(r["prompt_tokens"] for r in results)
            per_worker: dict = {}
            for r in results:
                per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
            rows[mode] = ((h1 - h0) / max(q1 - q0, 1), statistics.median(r["ttft"] for r in results), bound,
                          sorted(per_worker.values()))
        print(f"{'policy':<12} {'hit rate':>9} {'prev turn':>9} {'TTFT p50':>10} requests per worker")
        for mode, (hit, ttft, bound, spread) in rows.items():
            print(f"{mode:<12} {hit:>9.3f} {bound:>9.3f} {ttft * 1000:>8.0f}ms {spread}")
        rr, kv = rows["round-robin"], rows["kv"]
        print(f"kv / round-robin: hit rate {kv[0] / max(rr[0], 1e-9):.2f}x, TTFT p50 {kv[1] / rr[1]:.2f}x")
        applied: dict[str, float] = {}  # the KV router's verdict on the workers' events, by event and status
        for line in httpx.get(f"http://127.0.0.1:{policies['kv']}/metrics", timeout=10).text.splitlines():
            if line.startswith("dynamo_component_kv_cache_events_applied{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                key = f"{labels.get('event_type')}/{labels.get('status')}"
                applied[key] = applied.get(key, 0) + float(line.rsplit(" ", 1)[1])
        print("KV events the router applied:", ", ".join(f"{k} {v:.0f}" for k, v in sorted(applied.items()) if v)
              or "none")
        if a.kill_after > 0:
            asyncio.run(failover(f"http://127.0.0.1:{policies['kv']}", workers[1], a))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
