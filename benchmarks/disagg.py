"""Disaggregated vs aggregated serving on one machine, same image-heavy load, same run.

Setups: `vlserve serve` (aggregated), `serve --disagg --num-encoders 1` (1E+1L, i.e. E->PD), the same with 2
encoders (2E+1L), 1E+1L with a 16-token default allocation so every request resumes (resume overhead), and
E->P->D (`--num-prefill 1 --num-decode 1`: 1E+1P+1D, the prompt's KV moved to the decode instance; "at end": its
KV sent once the prompt is computed rather than layer by layer; "small run": a first run of 16 tokens, so every
prompt needs more of the decode instance's blocks; "tp2": every role at `--tensor-parallel-size 2`,
the KV moving between a prefill's and a decode's two ranks). Each gets
the same `vlserve bench serve` load (fresh pictures, so encoders really work). Also measures the ZeroMQ
transport's loopback bandwidth for embedding rows, receiver scatter included.

On a 2-core machine every process shares the same two cores: disaggregation cannot add compute here, so these
numbers show its overhead (transfers, extra processes), not its scaling.

    .venv/bin/python benchmarks/disagg.py [--model DIR] [--num-prompts 24] [--max-concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server_utils import free_port, scrape, wait_healthy  # noqa: E402
from vlserve.disagg.transports.zmq import ZmqTransport  # noqa: E402
from vlserve.engine.transfer_buffers import TransferBuffers  # noqa: E402


def run_setup(name: str, model: str, extra: list[str], encoders: int, bench: list[str], prefills: int = 0,
              tree: Path = ROOT) -> dict:
    """`tree`: the checkout whose vlserve serves (another one: the code before a change, in the same run)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "vlserve", "serve", "--model", model, "--dtype", "auto", "--port", str(port),
           "--max-model-len", "4096", "--disable-log-requests", *extra]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"disagg-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", 300, name, lambda: Path(log.name).read_text()[-3000:])
        deadline = time.monotonic() + 60
        peers = ("vlserve:prefill_instances_available", prefills) if prefills else \
            ("vlserve:encoders_available", encoders)
        while peers[1] and scrape(url + "/metrics").get(peers[0], 0) < peers[1]:
            assert time.monotonic() < deadline, "peers never joined"
            time.sleep(0.2)
        result = Path(tempfile.mkdtemp()) / "result.json"
        subprocess.run([sys.executable, "-m", "vlserve", "--log-level", "WARNING", "bench", "serve", "--base-url", url,
                        "--result-file", str(result), "--disable-tqdm", *bench], check=True, stdout=subprocess.DEVNULL)
        out = json.loads(result.read_text())["metrics"]
        m = scrape(url + "/metrics")
        out["transfer_bytes"] = m.get('vlserve:embedding_transfer_bytes_total{role="language"}', 0.0)
        out["kv_bytes"] = m.get('vlserve:kv_transfer_bytes_total{role="decode"}', 0.0)
        out["kv_transfer_s"] = m.get('vlserve:kv_transfer_latency_seconds_sum{role="decode"}', 0.0)
        out["kv_transfers"] = m.get('vlserve:kv_transfer_latency_seconds_count{role="decode"}', 0.0)
        out["resumes"] = m.get('vlserve:embedding_transfer_resumes_total{role="language"}', 0.0) + \
            m.get('vlserve:kv_transfer_resumes_total{role="decode"}', 0.0)
        return out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def transport_bandwidth(tokens: int = 512, hidden: int = 1024, rounds: int = 64) -> float:
    """GB/s of one picture's rows over loopback TCP through ZmqTransport's row socket, written into the receiver's
    blocks (each write answered once the rows are there)."""
    receiver, sender = ZmqTransport(), ZmqTransport()
    buffers = TransferBuffers.create(4 * tokens // 16, 16, hidden, torch.bfloat16)
    buffers.unlink()
    target = receiver.target(buffers)
    rows = torch.randn(tokens, hidden).bfloat16()
    blocks = buffers.allocate(tokens)
    try:
        t0 = time.perf_counter()
        sent = sum(sender.write_rows(target, blocks, rows) for _ in range(rounds))
        return sent / (time.perf_counter() - t0) / 1e9
    finally:
        sender.close()
        receiver.close()


def memory_copy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """GB/s of a plain memory copy on this machine: what any transfer on one host is bounded by."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--setups", help="comma-separated subset, e.g. aggregated,1E+1L,1E+1P+1D")
    ap.add_argument("--before", type=Path, help="another checkout (e.g. `git worktree add /tmp/before HEAD~3`): its "
                    "E->P->D setups run too, as the 'before' of a change, in the same run")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_vl", size="medium"))
    bench = ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--image-sizes",
             "448x448,336x336", "--images-per-request", "2", "--input-len", "16", "--output-len", "16", "--seed", "1"]
    setups = [("aggregated", [], 0, 0), ("1E+1L", ["--disagg", "--num-encoders", "1"], 1, 0),
              ("2E+1L", ["--disagg", "--num-encoders", "2"], 2, 0),
              ("1E+1L resume", ["--disagg", "--num-encoders", "1", "--media-allocate-rows", "16"], 1, 0),
              ("1E+1P+1D", ["--disagg", "--num-encoders", "1", "--num-prefill", "1", "--num-decode", "1"], 1, 1),
              ("1E+1P+1D shm", ["--disagg", "--num-encoders", "1", "--num-prefill", "1", "--num-decode", "1",
                                "--transfer-backend", "shm"], 1, 1),
              # the prefill sends its KV when the prompt is computed, not layer by layer as it is (#67)
              ("1E+1P+1D shm at end", ["--disagg", "--num-encoders", "1", "--num-prefill", "1", "--num-decode", "1",
                                       "--transfer-backend", "shm", "--no-kv-send-by-layer"], 1, 1),
              # a first run of 16 tokens: every prompt needs more of the decode instance's blocks (before #67's
              # RowsWanted, the rows past the first run were written after the prompt, on the front end's word)
              ("1E+1P+1D shm small run", ["--disagg", "--num-encoders", "1", "--num-prefill", "1", "--num-decode",
                                          "1", "--transfer-backend", "shm", "--kv-allocate-tokens", "16"], 1, 1)]
    # every role at two ranks (a prefill and a decode instance at 2: the handoff between ranks' KV files)
    setups += [(f"{name} tp2", [*extra, "--tensor-parallel-size", "2"], encoders, prefills)
               for name, extra, encoders, prefills in setups if prefills]
    if args.setups:
        setups = [s for s in setups if s[0] in args.setups.split(",")]
    runs = [(name, extra, encoders, prefills, ROOT) for name, extra, encoders, prefills in setups]
    if args.before:  # the E->P->D setups again, served by the other checkout
        runs += [(f"{name} before", extra, encoders, prefills, args.before.resolve())
                 for name, extra, encoders, prefills in setups if prefills]
    results = {}
    for name, extra, encoders, prefills, tree in runs:
        print(f"[{name}] running", flush=True)
        results[name] = run_setup(name, model, extra, encoders, bench, prefills, tree)
    base = results.get("aggregated") or next(iter(results.values()))
    print(f"\n{'setup':<21}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
          f"{'vs aggr.':>10}{'emb MB':>8}{'KV MB':>8}{'resumes':>9}")
    for name, r in results.items():
        print(f"{name:<21}{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}{r['median_ttft_ms']:>8.0f}ms"
              f"{r['p99_ttft_ms']:>8.0f}ms{r['median_tpot_ms']:>8.1f}ms"
              f"{r['request_throughput'] / base['request_throughput']:>9.2f}x"
              f"{r['transfer_bytes'] / 1e6:>8.1f}{r['kv_bytes'] / 1e6:>8.1f}{r['resumes']:>9.0f}")
    n = args.num_prompts
    copy_gbps = memory_copy_bandwidth()
    for name, r in results.items():
        if r["kv_transfers"]:  # E->P->D: what the handoff itself costs, against a memory copy of its bytes
            per = r["kv_bytes"] / r["kv_transfers"]
            took = r["kv_transfer_s"] / r["kv_transfers"]
            print(f"{name}: {per / 1e6:.2f} MB of KV per prompt, {took * 1e3:.1f} ms from request to last chunk "
                  f"(prefill included); a memory copy of it: {per / copy_gbps / 1e6:.2f} ms at {copy_gbps:.1f} GB/s")
    if "1E+1L" not in results:
        return
    print(f"\nbytes moved per picture request: {results['1E+1L']['transfer_bytes'] / n / 1e6:.2f} MB "
          "(embedding rows of media tokens only, plus 32 bytes of fill id and positions per token)")
    zmq_gbps = transport_bandwidth()
    print(f"ZeroMQ loopback, one picture's rows (512 tokens x 1024 bf16) into receive blocks: {zmq_gbps:.2f} GB/s; "
          f"this machine's memory copy: {copy_gbps:.1f} GB/s ({zmq_gbps / copy_gbps:.0%} of it)")


if __name__ == "__main__":
    main()
