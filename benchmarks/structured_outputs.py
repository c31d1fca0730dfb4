"""Decode step time with and without grammars, at batch 1 and 16, in the same run; and the mask work at the
vocabulary size of the real Qwen models.

    python benchmarks/structured_outputs.py [--model DIR] [--steps 48] [--dtype auto]

Part 1 runs the engine on the medium random checkpoint (made in /tmp if --model is not given). Every request
decodes `--steps` tokens: free rows with ignore_eos; constrained rows with a JSON schema that cannot be
complete within that many tokens, so both decode exactly as long. The figure is the median decode step
(prefill steps excluded), and the overhead is constrained / free - 1 (target: <= 10 % at batch 16).

Part 2 times the mask work alone (llguidance filling 15 masks inside a JSON string and one inside a JSON
number, then the sampler applying them to [16, V] logits) for the medium model's vocabulary and for a
synthetic byte-level vocabulary of Qwen's 151,936 tokens. The medium model has 8,000 tokens, so part 1 shows
the engine's overhead and part 2 how the mask work grows with a real vocabulary.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import llguidance
import llguidance.hf
import torch

from vlserve import LLM, SamplingParams
from vlserve.core.structured_outputs import StructuredOutputsParams
from vlserve.engine.sampler import TokenBitmask, _apply_token_bitmask
from vlserve.engine.structured.grammar import grammar_for
from vlserve.engine.structured.matchers import GrammarMatchers
from vlserve.tools.tiny_model import make_tiny_model

QWEN_VOCAB = 151_936
# Cannot be complete within a few hundred tokens: at least 64 notes.
LONG_JSON = {"type": "object", "properties": {
    "score": {"type": "integer"},
    "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}}, "required": ["score", "notes"]}
PROMPTS = ["Describe the receipt in the picture.", "List what you see.", "What is the total?", "Fill in the form."]


def decode_step_ms(llm: LLM, batch: int, steps: int, constrained: bool) -> float:
    """Median time of the engine steps in which every request decodes."""
    spec = {"json": LONG_JSON} if constrained else None
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, structured_outputs=spec)
    engine = llm.engine
    for i in range(batch):
        engine.add_request(PROMPTS[i % len(PROMPTS)] + f" ({i})", params)
    durations = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        durations.append(time.perf_counter() - t0)
    # The first steps prefill (and wait for the grammar); the rest decode one token per request.
    return statistics.median(durations[2:]) * 1e3


def engine_overhead(model: str, dtype: str, steps: int) -> int:
    """Prints the table; returns the model's vocabulary size."""
    llm = LLM(model, dtype=dtype, max_num_seqs=16)
    decode_step_ms(llm, 2, 4, True)  # warm-up: kernels, the grammar worker, llguidance's tokenizer
    print(f"\n1) engine decode step, {llm.engine.cfg.model.text.vocab_size} tokens vocabulary, {steps} steps")
    print(f"{'batch':>5} {'free ms':>9} {'json ms':>9} {'overhead':>9}")
    for batch in (1, 16):
        free, constrained = [], []
        for _ in range(3):  # alternate, keep the best of each: the machine is noisy
            free.append(decode_step_ms(llm, batch, steps, False))
            constrained.append(decode_step_ms(llm, batch, steps, True))
        f, c = min(free), min(constrained)
        print(f"{batch:>5} {f:>9.2f} {c:>9.2f} {c / f - 1:>+9.1%}")
    return llm.engine.cfg.model.text.vocab_size


def synthetic_tokenizer(vocab: int, seed: int = 0) -> llguidance.LLTokenizer:
    """A byte-level BPE vocabulary of `vocab` tokens, shaped like an LLM's: all bytes, then word pieces with
    and without a leading space, digits, punctuation runs and JSON fragments."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    byte_level = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(byte_level)
    seen = set(tokens)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ['",', '":', '{"', '"}', "],", "[]", "{}", "\\n", '":"', '","', "=", "==", "->", "()", "();"]
    while len(tokens) < vocab - 1:
        kind = rng.random()
        if kind < 0.75:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
            word = word.capitalize() if rng.random() < 0.2 else word
            text = (" " + word) if rng.random() < 0.6 else word
        elif kind < 0.85:
            text = str(rng.randint(0, 999))
        else:
            text = rng.choice(pieces) + rng.choice(["", " ", "\n"])
        token = "".join(_byte_char(b) for b in text.encode())
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    tokens.append("<|im_end|>")
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[])
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return llguidance.LLTokenizer(tok.to_str(), eos_token=len(tokens) - 1)


_BYTE_CHARS: dict[int, str] = {}


def _byte_char(b: int) -> str:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies store)."""
    if not _BYTE_CHARS:
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        extra = 0
        for i in range(256):
            if i in keep:
                _BYTE_CHARS[i] = chr(i)
            else:
                _BYTE_CHARS[i] = chr(256 + extra)
                extra += 1
    return _BYTE_CHARS[b]


def mask_work(tokenizer: llguidance.LLTokenizer, vocab: int, label: str, repeats: int = 20) -> None:
    spec = StructuredOutputsParams(json=LONG_JSON)
    fresh = llguidance.LLMatcher(tokenizer, grammar_for(spec), log_level=0)
    in_string, in_number = fresh.deep_copy(), fresh.deep_copy()
    for m, text in ((in_string, '{"score":1,"notes":["the quick bro'), (in_number, '{"score":12')):
        if not m.consume_tokens(tokenizer.tokenize_str(text)):
            raise RuntimeError(f"the benchmark's prefix does not match its grammar: {m.get_error()}")
    matchers = GrammarMatchers(Path("."), (tokenizer.eos_token,), vocab)
    batch = [in_string.deep_copy() for _ in range(15)] + [in_number]
    logits = torch.randn(16, vocab)
    fill, apply = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bits = matchers._fill_masks(batch)
        t1 = time.perf_counter()
        _apply_token_bitmask(logits.clone(), TokenBitmask(list(range(16)), bits))
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
    matchers.shutdown()
    allowed = [int(sum(bin(w & 0xFFFFFFFF).count("1") for w in row.tolist())) for row in bits[[0, 15]]]
    print(f"{label:>28} {vocab:>8} {min(fill) * 1e3:>9.2f} {min(apply) * 1e3:>9.2f}   "
          f"allowed: {allowed[0]} in a string, {allowed[1]} in a number")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the medium random Qwen2-VL, made in /tmp)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = args.model
    if model is None:
        model = str(Path(tempfile.gettempdir()) / "vlserve-bench-medium-qwen2_vl")
        if not (Path(model) / "config.json").exists():
            make_tiny_model(model, arch="qwen2_vl", size="medium")
    vocab = engine_overhead(model, args.dtype, args.steps)

    print("\n2) mask work for 16 rows (llguidance's fill + the sampler's apply), best of 20")
    print(f"{'vocabulary':>28} {'tokens':>8} {'fill ms':>9} {'apply ms':>9}")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model)
    mask_work(llguidance.hf.from_tokenizer(hf, n_vocab=vocab), vocab, "medium checkpoint")
    mask_work(synthetic_tokenizer(QWEN_VOCAB), QWEN_VOCAB, "synthetic, Qwen-sized")


if __name__ == "__main__":
    main()
