"""Host time of one decode step (#70 item 1): what the engine's own Python spends per step around the model,
by batch size and context length, with the device's work (the forward pass and the sampling kernels) timed
apart and taken out, so what is left is what async scheduling must hide behind the GPU's graph (the aim: under
1 ms a step for Qwen2.5-VL-3B's shapes, whose graph takes ~1.3 ms on an H200).

Each setting runs B requests of C prompt tokens to their decode phase, then times `--steps` decode steps:
- step: `EngineCore.step()` whole;
- device: `ModelShard.forward` minus the attention metadata it builds (host work), plus `ModelRunner._sample`
  minus the sampling metadata it builds (host work);
- host = step - device, split into schedule (`Scheduler.schedule`), inputs (`ModelRunner._prepare`: token ids,
  positions, slots, block table), metadata (`attention_metadata` and `SamplingMetadata.build`) and the rest
  (reading the tokens, outputs, bookkeeping);
- uploads: tensors `to_device` was given per step (on a GPU each is a host->device copy).
A tiny random checkpoint by default: its forward pass is small, which keeps the run short; the host side does not
depend on the model's size. Every run is a process of its own; `--before DIR` (another checkout, e.g. `git worktree
add /tmp/before HEAD~3`) runs each setting there too, alternating with this tree's, as the baseline of a change.

    .venv/bin/python benchmarks/host_step.py [--model DIR] [--batches 1,8,32,128] [--contexts 256,2048]
                                             [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("VLSERVE_TREE", str(ROOT)))  # the checkout measured (--before: another one)

from vlserve.core.config import EngineArgs  # noqa: E402
from vlserve.core.prompt import ProcessedPrompt  # noqa: E402
from vlserve.core.sampling_params import SamplingParams  # noqa: E402
from vlserve.engine import forward_batch, model_runner, model_shard  # noqa: E402
from vlserve.engine.config import resolve_config  # noqa: E402
from vlserve.engine.core import EngineCore  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(owner, name: str, key: str, classmethod_: bool = False) -> None:
    """Wraps `owner.name` so its seconds add up under `key` (`classmethod_`: the wrapper calls the bound one)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - t

    setattr(owner, name, staticmethod(wrapper) if classmethod_ else wrapper)


def counted_uploads(module) -> None:
    inner = module.to_device

    def wrapper(t, *args, **kwargs):
        COUNTS["uploads"] += 1
        return inner(t, *args, **kwargs)

    module.to_device = wrapper


def prompt(num_tokens: int, vocab: int, seed: int) -> ProcessedPrompt:
    ids = torch.randint(10, vocab - 10, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ProcessedPrompt(ids, [], torch.arange(num_tokens).expand(3, -1).clone(), 0)


def measure(model: str, batch: int, context: int, steps: int) -> dict[str, float]:
    step_tokens = max(2048, context)
    # the first requests decode while the last ones are prefilled: each runs until every one has decoded `steps`
    max_tokens = steps + 16 + -(-batch * context // step_tokens)
    length = context + max_tokens
    cfg = resolve_config(EngineArgs(model=model, dtype="float32", max_num_seqs=batch, enable_prefix_caching=False,
                                    max_model_len=length, max_num_batched_tokens=step_tokens,
                                    num_kv_blocks=batch * -(-length // 16) + 16, async_scheduling=False),
                         announce=False)
    core = EngineCore(cfg)
    vocab = cfg.model.text.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", prompt(context, vocab, i), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(3):  # warm-up decode steps
        core.step()
    if len(core.scheduler.running) != batch:
        raise RuntimeError(f"{len(core.scheduler.running)} of {batch} requests decode")
    TIMES.clear()
    COUNTS.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    total = time.perf_counter() - t0
    out = {k: v / steps * 1e3 for k, v in TIMES.items()}
    out["step"] = total / steps * 1e3
    out["uploads"] = COUNTS["uploads"] / steps
    core.shutdown()
    return out


def instrument() -> None:
    timed(model_shard.ModelShard, "forward", "forward")
    timed(model_shard, "attention_metadata", "metadata")
    timed(model_runner.ModelRunner, "_sample", "sample")
    timed(model_runner.SamplingMetadata, "build", "sampling metadata", classmethod_=True)
    timed(model_runner.ModelRunner, "_prepare", "inputs")
    from vlserve.engine import scheduler

    timed(scheduler.Scheduler, "schedule", "schedule")
    for module in (forward_batch, model_shard, model_runner):
        counted_uploads(module)


def run_once(tree: Path, model: str, batch: int, context: int, steps: int) -> dict[str, float]:
    """One setting measured in a process of its own, importing vlserve from `tree`."""
    env = {**os.environ, "VLSERVE_TREE": str(tree), "PYTHONPATH": str(tree)}
    got = subprocess.run([sys.executable, __file__, "--one", json.dumps([model, batch, context, steps])], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="the median of this many runs of each setting")
    ap.add_argument("--before", type=Path, help="another checkout measured alongside, as the baseline")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # [model, batch, context, steps]: one run, JSON out
    args = ap.parse_args()
    if args.one:
        instrument()
        print(json.dumps(measure(*json.loads(args.one))))
        return
    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="qwen2_5_vl"))
    trees = [("this", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    print(f"{torch.get_num_threads()} torch threads; ms per decode step (medians of {args.rounds} runs of "
          f"{args.steps} steps; device: the forward pass and sampling; host: the rest)")
    print(f"{'tree':>7}{'batch':>6}{'context':>9}{'step':>8}{'device':>8}{'host':>8}{'schedule':>10}{'inputs':>8}"
          f"{'metadata':>10}{'rest':>7}{'uploads':>9}{'host vs before':>16}")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
            for _ in range(args.rounds):  # the trees alternate: a noisy stretch hits both
                for name, tree in trees:
                    runs[name].append(run_once(tree, model, batch, context, args.steps))
            hosts = {}
            for name, _ in trees:
                def med(key: str, got=runs[name]) -> float:
                    return statistics.median(r.get(key, 0.0) for r in got)

                def device_of(r: dict) -> float:
                    return (r.get("forward", 0.0) - r.get("metadata", 0.0) + r.get("sample", 0.0)
                            - r.get("sampling metadata", 0.0))

                device = statistics.median(device_of(r) for r in runs[name])
                host = hosts[name] = statistics.median(r["step"] - device_of(r) for r in runs[name])
                meta = med("metadata") + med("sampling metadata")
                rest = host - med("schedule") - med("inputs") - meta
                ratio = f"{host / hosts['this']:>15.2f}x" if name == "before" else ""
                print(f"{name:>7}{batch:>6}{context:>9}{med('step'):>8.2f}{device:>8.2f}{host:>8.2f}"
                      f"{med('schedule'):>10.2f}{med('inputs'):>8.2f}{meta:>10.2f}{rest:>7.2f}"
                      f"{med('uploads'):>9.1f}{ratio}")


if __name__ == "__main__":
    main()
