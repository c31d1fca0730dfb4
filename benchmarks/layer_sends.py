"""What sending a prompt's KV layer by layer as it is computed saves a prefill instance (#67 item 3), timed in one
run on the same prompts: a prefill engine with the shm row writer (as `vlserve prefill --transfer-backend shm`
makes it) computes a fresh prompt and sends its rows into a decode KV file
(engine.kv_connector.layer_sends), either

- by layer: each layer's keys and values of each step's tokens are queued for the writer thread right after the
  layer ran, so the writes overlap the rest of the forward pass; or
- at the finish (`--no-kv-send-by-layer`): the whole run is written by the same thread once the prompt is done.

Timed per prompt: the prefill (request in to first token out), the handoff after it (first token out to the
send's answer: what a decode instance waits for on top of the prefill), and both together; beside one memory
copy of the same rows (the bound of the handoff). Prompts of `--tokens` text tokens, computed in steps of
`--step-tokens` (chunked prefill), prefix caching off so every round computes everything.

    .venv/bin/python benchmarks/layer_sends.py [--model DIR] [--tokens 2000] [--step-tokens 2048] [--rounds 5]

Default model: the medium random Qwen2-VL checkpoint (make-tiny-model --size medium: 12 layers x K,V x 2 KV heads
x 128 values a token).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlserve.core.prompt import ProcessedPrompt  # noqa: E402
from vlserve.core.sampling_params import SamplingParams  # noqa: E402
from vlserve.core.wire import KVSend  # noqa: E402
from vlserve.disagg.transports.row_writer import encode_destination, row_writer_maker  # noqa: E402
from vlserve.disagg.transports.shm import ShmTransport  # noqa: E402
from vlserve.core.config import EngineArgs  # noqa: E402
from vlserve.engine.config import resolve_config  # noqa: E402
from vlserve.engine.core import EngineCore  # noqa: E402
from vlserve.engine.kv_connector import make_connector  # noqa: E402
from vlserve.engine.transfer_buffers import TransferBuffers  # noqa: E402


def text_prompt(num_tokens: int, vocab: int, seed: int) -> ProcessedPrompt:
    ids = torch.randint(10, vocab - 10, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    positions = torch.arange(num_tokens).expand(3, -1).clone()
    return ProcessedPrompt(ids, [], positions, 0)


def one_send(core: EngineCore, prompt: ProcessedPrompt, rid: str, send: KVSend) -> tuple[float, float]:
    """(prefill seconds, handoff seconds after it) of one prompt sent while it is computed."""
    connector = core.connector
    t0 = time.perf_counter()
    core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1).for_prefill(), kv_send=send)
    while core.has_unfinished:
        core.step()
    t_first = time.perf_counter()
    connector.take_exported()
    while True:
        answers = connector.take_written()
        if answers:
            break
        time.sleep(0.0002)
    t_sent = time.perf_counter()
    (answer,) = answers
    if answer.error is not None:
        raise RuntimeError(answer.error)
    core.abort_requests([rid])  # the transfer is over: the kept blocks go
    return t_first - t0, t_sent - t_first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--step-tokens", type=int, default=2048, help="--max-num-batched-tokens of the prefill engine")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model
        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_vl", size="medium"))
    cfg = resolve_config(EngineArgs(model=model, dtype="auto", enable_prefix_caching=False,
                                    max_num_batched_tokens=args.step_tokens, max_model_len=args.tokens + 64),
                         announce=False)
    writer = row_writer_maker("shm", "127.0.0.1", 120.0)()
    core = EngineCore(cfg, connector=make_connector("prefill", cfg, writer))
    text = cfg.model.text
    width, parts = cfg.model.kv_row_width, 2 * text.num_kv_layers
    block = 16
    decode_kv = TransferBuffers.create(-(-args.tokens // block) + 1, block, width, cfg.dtype, parts=parts)
    target = ShmTransport().target(decode_kv)
    blocks = list(range(-(-args.tokens // block)))
    destination = encode_destination(target, blocks, "shm")
    rows = torch.empty(args.tokens, width, dtype=cfg.dtype).normal_()
    nbytes = rows.numel() * rows.element_size()
    print(f"{cfg.model.architecture}, {str(cfg.dtype).removeprefix('torch.')}, {text.num_kv_layers} KV layers, "
          f"{args.tokens} tokens in steps of {args.step_tokens}: {nbytes / 2**20:.1f} MB of KV rows; "
          f"{torch.get_num_threads()} threads")
    times: dict[str, list[tuple[float, float]]] = {"by layer": [], "at the finish": []}
    copy = []
    seed = 0
    for _ in range(args.rounds + 1):  # the first round warms up (not counted)
        for mode in times:
            core.connector.by_layer = mode == "by layer"
            seed += 1
            got = one_send(core, text_prompt(args.tokens, text.vocab_size, seed), f"r{seed}",
                           KVSend(seed, args.tokens, destination, float("inf")))
            if seed > len(times):
                times[mode].append(got)
        out = torch.empty_like(rows)
        t = time.perf_counter()
        out.copy_(rows)
        copy.append(time.perf_counter() - t)
    bound = statistics.median(copy[1:])
    print(f"memory copy of the rows (the handoff's bound): {bound * 1e3:.1f} ms")
    print(f"{'':16s} {'prefill':>10s} {'handoff after it':>18s} {'both':>10s}   (medians of {args.rounds}, ms)")
    base = None
    for mode, got in times.items():
        prefill = statistics.median(p for p, _ in got)
        handoff = statistics.median(h for _, h in got)
        both = statistics.median(p + h for p, h in got)
        base = base or (prefill, handoff, both)
        print(f"{mode:16s} {prefill * 1e3:10.1f} {handoff * 1e3:12.2f} ({handoff / bound:4.1f}x) {both * 1e3:10.1f}"
              f"   vs by layer: prefill {prefill / base[0]:.2f}x, handoff {handoff / base[1]:.1f}x, "
              f"both {both / base[2]:.3f}x")
    core.connector.close()
    core.shutdown()
    decode_kv.unlink()


if __name__ == "__main__":
    main()
