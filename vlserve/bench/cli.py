"""`vlserve bench serve ...`: load-test an OpenAI-compatible chat server with random multimodal requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


log = logging.getLogger("vlserve.bench")


def parse_percentiles(text: str) -> tuple[float, ...]:
    vals = tuple(float(x) for x in text.split(",") if x.strip())
    if not vals or any(not 0 < v <= 100 for v in vals):
        raise argparse.ArgumentTypeError("percentiles must be a comma list of numbers in (0, 100]")
    return vals


def parse_count_per_request(text: str) -> tuple[int, int | None]:
    """'2' -> (2, None); '1-3' -> (1, 3), a uniform count per request (pictures or audio clips)."""
    try:
        if "-" in text:
            lo, hi = text.split("-")
            return int(lo), int(hi)
        return int(text), None
    except ValueError:
        raise argparse.ArgumentTypeError("expected N or MIN-MAX, such as 1 or 1-3") from None


# The workload and the client (numpy, PIL, httpx) are imported when the command runs: every vlserve process
# builds this parser.
def _image_sizes(text: str) -> list[tuple[int, int]]:
    from vlserve.bench.dataset import parse_image_sizes

    try:
        return parse_image_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _audio_seconds(text: str) -> list[float]:
    from vlserve.bench.dataset import parse_audio_seconds

    try:
        return parse_audio_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    g.add_argument("--endpoint", default="/v1/chat/completions", help="path of the chat API")
    g.add_argument("--model", default=None, help="model name to send; if omitted, the first one GET /v1/models lists")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")

    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send")
    g.add_argument("--input-len", type=_positive_int, default=64, help="words of random text per request")
    g.add_argument("--output-len", type=_positive_int, default=64, help="max_tokens per request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="0: fixed lengths; r: lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--image-sizes", type=_image_sizes, default="448x448",
                   help="comma list of WIDTHxHEIGHT, one picked at random per image")
    g.add_argument("--images-per-request", type=parse_count_per_request, default="1",
                   help="N, or MIN-MAX for a uniform count per request")
    g.add_argument("--repeat-image-ratio", type=float, default=0.0,
                   help="share of images re-used from a small pool of earlier ones (cache hits)")
    g.add_argument("--repeat-pool-size", type=_positive_int, default=8,
                   help="distinct pictures that repeated images are drawn from")
    g.add_argument("--image-format", choices=["jpeg", "png"], default="jpeg",
                   help="encoding of the data URLs (jpeg is much cheaper to build)")
    g.add_argument("--audios-per-request", type=parse_count_per_request, default="0",
                   help="input_audio clips (synthetic tones, base64 WAV) per request: N, or MIN-MAX")
    g.add_argument("--audio-seconds", type=_audio_seconds, default="5",
                   help="comma list of clip lengths in seconds, one picked at random per clip")
    g.add_argument("--audio-sample-rate", type=int, default=16000,
                   help="rate of the WAV clips (not the model's makes the server resample)")
    g.add_argument("--repeat-audio-ratio", type=float, default=0.0,
                   help="share of clips re-used from a small pool of earlier ones (cache hits)")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrival times")

    g = p.add_argument_group("sampling and load")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second; inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 is Poisson, <1 burstier, >1 steadier")
    g.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="most requests in flight at once; unset: no cap")

    g = p.add_argument_group("output")
    g.add_argument("--percentiles", type=parse_percentiles, default="50,90,99",
                   help="comma list, e.g. 50,90,99")
    g.add_argument("--result-file", default=None, help="write config, metrics and per-request data as JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_serve(args: argparse.Namespace) -> int:
    """Build the workload, run it, print the table; exit 1 if no request succeeded."""
    from vlserve.bench.dataset import RandomMMConfig, build_requests
    from vlserve.bench.serve import (RunOptions, compute_metrics, error_counts, format_table, request_summaries,
                                     run_benchmark)

    if args.burstiness <= 0 or args.request_rate <= 0:
        log.error("--burstiness and --request-rate must be > 0")
        return 2
    # httpx logs every request at INFO, which would bury the results.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    lo, hi = args.images_per_request
    audio_lo, audio_hi = args.audios_per_request
    cfg = RandomMMConfig(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, image_sizes=args.image_sizes, images_per_request=lo,
        max_images_per_request=hi, repeat_image_ratio=args.repeat_image_ratio,
        repeat_pool_size=args.repeat_pool_size, image_format=args.image_format, audios_per_request=audio_lo,
        max_audios_per_request=audio_hi, audio_seconds=args.audio_seconds, audio_sample_rate=args.audio_sample_rate,
        repeat_audio_ratio=args.repeat_audio_ratio, seed=args.seed,
    )
    try:
        t0 = time.perf_counter()
        requests = build_requests(cfg)
    except ValueError as e:
        log.error("%s", e)
        return 2
    log.info("built %d requests (%d images, %d audio clips, %.0f s of sound) in %.1f s", len(requests),
             sum(r.num_images for r in requests), sum(r.num_audios for r in requests),
             sum(r.audio_seconds for r in requests), time.perf_counter() - t0)
    opts = RunOptions(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, temperature=args.temperature,
        ignore_eos=args.ignore_eos, api_key=args.api_key, timeout=args.timeout,
        disable_tqdm=args.disable_tqdm, seed=args.seed,
    )
    try:
        records, duration, model = asyncio.run(run_benchmark(requests, opts))
    except Exception as e:  # noqa: BLE001 - e.g. server down while asking /v1/models
        log.error("benchmark could not start: %s: %s", type(e).__name__, e)
        return 1
    metrics = compute_metrics(records, duration, args.percentiles)
    print(format_table(metrics, args.percentiles))
    errors = error_counts(records)
    if errors:
        print("Most common errors:")
        for text, n in errors.items():
            print(f"  {n:>5} x {text[:200]}")
    sys.stdout.flush()
    if args.result_file:
        config: dict[str, Any] = {k: v for k, v in asdict(opts).items() if k != "api_key"}
        config.update(model=model, dataset={**asdict(cfg), "image_sizes": [list(s) for s in cfg.image_sizes]},
                      percentiles=list(args.percentiles))
        if math.isinf(config["request_rate"]):
            config["request_rate"] = "inf"  # JSON has no infinity
        result = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": config,
            "metrics": metrics,
            "errors": errors,
            "requests": request_summaries(records),
        }
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        log.info("wrote %s", path)
    return 0 if metrics["completed"] > 0 else 1


def register_cli(subparsers: Any) -> None:
    """Add `bench serve ...` (room for more `bench` subcommands later)."""
    bench = subparsers.add_parser("bench", help="benchmarks", description="Benchmark tools.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible chat server",
        description="Send random multimodal chat requests to a running server and report TTFT, TPOT, "
                    "ITL, end-to-end latency and throughput.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)
