"""How far a quantized model's logits are from the unquantized model's, on teacher-forced text (the same token
sequences through both, one prefill each or a few tokens a pass): what `benchmarks/quantization.py` prints and the
test suite bounds."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from vlserve.model.hf_config import load_model_config
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span
from vlserve.model.loader import load_model
from vlserve.model.quantization import resolve_quantization


class LogitDeviation(msgspec.Struct, frozen=True):
    positions: int
    cosine: float  # mean over positions of the logits' cosine similarity
    max_abs: float  # the largest deviation of any logit
    max_abs_relative: float  # max_abs over the largest reference logit's magnitude
    top1_agreement: float  # share of positions whose greedy token is the reference's
    kl_mean: float  # mean over positions of KL(reference || quantized) of the next-token distributions, in nats


@torch.inference_mode()
def teacher_forced_logits(folder: str | Path, method: str | None, dtype: str, sequences: list[torch.Tensor],
                          rows_per_pass: int | None = None) -> torch.Tensor:
    """Logits at every position of each sequence: [positions, vocab] fp32. `method`: None, "int8" (made at load
    time) or a checkpoint's own quantization ("awq"/"gptq", read from its config). One prefill a sequence, or
    `rows_per_pass` tokens a pass over the cache of the ones before (a few: the arithmetic of decode steps)."""
    cfg = load_model_config(str(folder))
    model = load_model(Path(folder), cfg, dtype, with_vision=False,
                       quantization=resolve_quantization(method if method == "int8" else None, cfg.quantization))
    if hasattr(model, "pack_for_cpu"):
        from vlserve.model.layers.packed_linear import packed_linear_supported

        if packed_linear_supported(torch.device("cpu"), next(model.parameters()).dtype):
            model.pack_for_cpu()
    t = cfg.text
    out = []
    for ids in sequences:
        n = len(ids)
        kv = [torch.zeros(2, n, t.num_kv_heads, t.head_dim, dtype=model.language_model.norm.weight.dtype)
              for _ in range(t.num_layers)]
        step = rows_per_pass or n
        for a in range(0, n, step):
            b = min(n, a + step)
            span = build_prefill_span(0, b - a, b, torch.arange(b) if a else None)
            meta = AttentionMetadata(slot_mapping=torch.arange(a, b), prefills=[span])
            hidden = model(model.embed_tokens(ids[a:b]), torch.arange(a, b).expand(3, -1), kv, meta)
            out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def deviation(logits: torch.Tensor, reference: torch.Tensor) -> LogitDeviation:
    diff = (logits - reference).abs().max().item()
    return LogitDeviation(
        positions=reference.shape[0],
        cosine=torch.nn.functional.cosine_similarity(logits, reference, dim=-1).mean().item(),
        max_abs=diff, max_abs_relative=diff / max(reference.abs().max().item(), 1e-30),
        top1_agreement=(logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        kl_mean=torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                           reduction="batchmean").item())


def random_sequences(vocab_size: int, positions: int, per_sequence: int = 128, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (per_sequence,), generator=gen)
            for _ in range(max(1, positions // per_sequence))]
