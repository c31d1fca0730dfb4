"""Load generator for any OpenAI-compatible streaming chat endpoint, and the metrics it reports.

The runner sends the requests of `dataset.build_requests` on a Poisson (or gamma) arrival
process, optionally capped at a fixed concurrency, and records when each streamed chunk
arrives. `compute_metrics` turns those records into latency and throughput figures; it is a
pure function so it can be tested on hand-made records.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
import numpy as np
from tqdm import tqdm

from vlserve.bench.dataset import BenchRequest


@dataclass
class RequestRecord:
    """What one request did; all times in seconds (time.perf_counter clock)."""

    success: bool = False
    error: str = ""
    send_time: float = 0.0
    end_time: float = 0.0
    ttft: float | None = None  # send -> first content chunk; None if no content came back
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    latency: float = 0.0  # send -> end of stream
    prompt_tokens: int | None = None  # from the usage chunk, if the server sent one
    completion_tokens: int = 0  # usage count, else the number of content chunks
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    num_chunks: int = 0
    num_images: int = 0
    num_audios: int = 0


@dataclass
class RunOptions:
    base_url: str
    endpoint: str = "/v1/chat/completions"
    model: str | None = None  # None: ask GET /v1/models and take the first
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    timeout: float = 600.0
    disable_tqdm: bool = False
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# Metrics


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float | None]:
    """mean / median / pXX of a list of seconds, in milliseconds (None when there is no data)."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    have = arr.size > 0
    out[f"mean_{name}_ms"] = float(arr.mean()) if have else None
    out[f"median_{name}_ms"] = float(np.median(arr)) if have else None
    out[f"std_{name}_ms"] = float(arr.std()) if have else None
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p)) if have else None
    return out


def max_overlap(records: list[RequestRecord]) -> int:
    """Most requests that were in flight at the same moment."""
    events = sorted([(r.send_time, 1) for r in records] + [(r.end_time, -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # ends sort before starts at equal times
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def compute_metrics(records: list[RequestRecord], duration_s: float,
                    percentiles: tuple[float, ...] = (50, 90, 99)) -> dict[str, Any]:
    """Throughput over `duration_s` and latency statistics over the successful requests only."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    dur = max(duration_s, 1e-9)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    # TPOT excludes the first token, whose cost is prefill; it needs two tokens to be defined.
    tpots = [(r.latency - r.ttft) / (r.completion_tokens - 1)
             for r in ok if r.ttft is not None and r.completion_tokens > 1]
    itls = [gap for r in ok for gap in r.itl]
    e2es = [r.latency for r in ok]
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "total_cached_input_tokens": cached,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "max_concurrent_requests": max_overlap(records) if records else 0,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        m.update(_stats(name, vals, percentiles))
    return m


def format_table(m: dict[str, Any], percentiles: tuple[float, ...]) -> str:
    def row(label: str, value: Any, fmt: str = "{:.2f}") -> str:
        text = "-" if value is None else (fmt.format(value) if isinstance(value, float) else str(value))
        return f"{label:<40}{text:>12}"

    lines = [
        "{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="),
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
        row("Max concurrent requests seen:", m["max_concurrent_requests"]),
        row("Benchmark duration (s):", m["duration_s"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Cached input tokens (server-reported):", m["total_cached_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_token_throughput"]),
    ]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        short = key.upper()
        lines.append("{s:{c}^52}".format(s=f" {title} ", c="-"))
        lines.append(row(f"Mean {short} (ms):", m[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", m[f"median_{key}_ms"]))
        for p in percentiles:
            if p != 50:  # same as the median row above
                lines.append(row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"]))
    lines.append("=" * 52)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Runner


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def fetch_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key))
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def request_body(req: BenchRequest, model: str, opts: RunOptions) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:  # only sent when on, so strict servers that reject unknown fields still work
        body["ignore_eos"] = True
    return json.dumps(body).encode()


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def send_one(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: bytes,
                   rec: RequestRecord) -> None:
    """Stream one chat completion, filling `rec`. Never raises except on cancellation."""
    rec.send_time = time.perf_counter()
    last = rec.send_time
    finished = False
    try:
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ': keep-alive' comments, 'event:' lines
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if event.get("error") is not None:
                    rec.error = "stream error: " + _error_text(event["error"])
                    return
                got_text = False
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    # Reasoning text is generated tokens too; counting it keeps TTFT meaningful
                    # for servers that stream a reasoning part first.
                    if delta.get("content") or delta.get("reasoning_content"):
                        got_text = True
                    if choice.get("finish_reason"):
                        finished = True
                if got_text:
                    if rec.ttft is None:
                        rec.ttft = now - rec.send_time
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.num_chunks += 1
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
        if not finished:
            rec.error = "stream ended without [DONE] or a finish_reason"
            return
        if rec.completion_tokens == 0:
            rec.completion_tokens = rec.num_chunks  # server sent no usage chunk
        rec.success = True
    except Exception as e:  # noqa: BLE001 - one bad request must not abort the whole run
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end_time = time.perf_counter()
        rec.latency = rec.end_time - rec.send_time


async def arrivals(n: int, rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Yield 0..n-1 at the times of a gamma renewal process (Poisson when burstiness is 1).

    Gamma with shape k and scale 1/(rate*k) keeps the mean rate at `rate`; smaller k is burstier.
    Sleeps target absolute times so that scheduling delays do not add up into a lower rate.
    """
    if math.isinf(rate):
        for i in range(n):
            yield i
        return
    rng = np.random.default_rng(seed)
    target = time.perf_counter()
    for i in range(n):
        yield i
        target += float(rng.gamma(burstiness, 1.0 / (rate * burstiness)))
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


async def run_benchmark(requests: list[BenchRequest], opts: RunOptions) -> tuple[list[RequestRecord], float, str]:
    """Send every request; return (records in request order, wall duration in s, model name)."""
    url = opts.base_url.rstrip("/") + opts.endpoint
    headers = _headers(opts.api_key)
    # Without a concurrency cap the pool must not queue requests either: httpx's default of 100
    # connections would silently cap concurrency and count queueing time as server latency.
    limits = httpx.Limits(max_connections=opts.max_concurrency, max_keepalive_connections=opts.max_concurrency)
    timeout = httpx.Timeout(opts.timeout)
    # trust_env=False: a benchmark must talk to the server directly, never through an env proxy.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = opts.model or await fetch_model(client, opts.base_url, opts.api_key)
        # Serialise up front: json.dumps of megabytes of base64 would stall the event loop mid-run.
        bodies = [request_body(r, model, opts) for r in requests]
        records = [RequestRecord(num_images=r.num_images, num_audios=r.num_audios) for r in requests]
        sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
        bar = tqdm(total=len(requests), disable=opts.disable_tqdm, desc="requests")

        async def one(i: int) -> None:
            async def go() -> None:
                try:
                    await asyncio.wait_for(send_one(client, url, headers, bodies[i], records[i]), opts.timeout)
                except asyncio.TimeoutError:
                    records[i].success = False
                    records[i].error = f"timed out after {opts.timeout:g} s"
            if sem is None:
                await go()
            else:
                async with sem:
                    await go()
            bar.update(1)

        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(requests), opts.request_rate, opts.burstiness, opts.seed):
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return records, duration, model


def request_summaries(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Per-request figures for the result file (ITL gaps summarised, not listed)."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000.0, 3)

    out = []
    for r in records:
        out.append({
            "success": r.success,
            "error": r.error or None,
            "ttft_ms": ms(r.ttft),
            "e2el_ms": ms(r.latency),
            "mean_itl_ms": ms(sum(r.itl) / len(r.itl)) if r.itl else None,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "output_tokens": r.completion_tokens,
            "num_chunks": r.num_chunks,
            "num_images": r.num_images,
            "num_audios": r.num_audios,
        })
    return out


def error_counts(records: list[RequestRecord], top: int = 10) -> dict[str, int]:
    return dict(Counter(r.error for r in records if not r.success).most_common(top))
