"""Sparse mixture-of-experts MLP (Qwen3-VL-MoE, Qwen3.5-MoE): softmax router -> top-k -> renormalized weights;
Qwen3.5 adds a shared expert (a gated MLP every token runs) scaled by sigmoid(shared_expert_gate(x)).

Experts are stored as two 3-D weights in the linear layout, `gate_up_proj [E, 2I, H]` and
`down_proj [E, H, I]`. Tokens are grouped by expert with one sort, then each expert that got tokens runs one
GEMM over all of them: a Python loop over experts, never over tokens. Contributions are summed in expert order,
as the reference does. LoRA adapters of the expert weights (PEFT's `target_parameters`) add each token's adapter's
low-rank delta of the expert it runs: one pair of GEMMs per (expert, adapter) over that expert's tokens of that
adapter. A pass captured as a graph (`static_shapes`) cannot read the counts: it runs each
(token, expert) pair on its expert's gathered weights when that gathers no more than every expert once, else every
expert on every token with zero weight where it was not chosen; both add a token's experts in ascending order, as
the reference does. On CUDA (no adapter running) both kinds of pass are two grouped GEMM launches instead
(kernels/triton_moe.py: no loop, no host sync). On CPU, `pack` swaps each expert's two matrices for
oneDNN-prepacked copies (see packed_linear.py: bf16 where the CPU has it natively, bit-identical; fp32
everywhere, within an ulp), as the dense linears get.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlserve.model.kernels import fused_moe_wanted, triton_moe_kernels
from vlserve.model.layers.lora_rows import active_rows
from vlserve.model.layers.mlp import GatedMLP, get_activation
from vlserve.model.layers.parallel import Column, Row, current_tp, even_split
from vlserve.model.layers.static_shapes import active as static_shapes_active


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str,
                 shared_intermediate: int = 0):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = Experts(hidden, intermediate, num_experts, act)
        self.tp = current_tp()
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act, bias=False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = self.tp.all_reduce(self.experts(x, experts, weights))
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, act: str):
        super().__init__()
        self.num_experts = num_experts
        # Tensor parallel: every rank runs every expert on a slice of its intermediate columns; SparseMoE reduces.
        cols = even_split(intermediate, current_tp(), "expert intermediate size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * cols.size, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, cols.size))
        self.tp_rules = {"gate_up_proj": Column({"gate": cols, "up": cols}, dim=1), "down_proj": Row(cols, dim=2)}
        # (in, out) features of each expert's matrix of the two 3-D weights: what a LoRA adapter of them fits
        self.lora_shapes = {"gate_up_proj": (hidden, 2 * cols.size), "down_proj": (cols.size, hidden)}
        # 3-D weight name -> per LoRA slot (A [E, r, in], B [E, out, r]) or None (vlserve.lora fills them)
        self.lora: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self.act = get_activation(act)
        self.packed: list[tuple[nn.Module, nn.Module]] | None = None

    def pack(self) -> int:
        """Prepacked per-expert linears in place of the 3-D weights (which are dropped: no second copy)."""
        from vlserve.model.layers.packed_linear import PackedLinear

        self.packed = [(PackedLinear(self.gate_up_proj[e], None), PackedLinear(self.down_proj[e], None))
                       for e in range(self.num_experts)]
        del self.gate_up_proj, self.down_proj
        return 2 * self.num_experts

    def _expert(self, e: int, x: torch.Tensor, spans: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """`spans`: (LoRA slot, first row, end row) of the rows whose adapter adapts these weights."""
        gate_up = self.packed[e][0](x) if self.packed is not None else F.linear(x, self.gate_up_proj[e])
        if spans:
            self._add_lora("gate_up_proj", e, x, gate_up, spans)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act(gate) * up
        y = self.packed[e][1](h) if self.packed is not None else F.linear(h, self.down_proj[e])
        if spans:
            self._add_lora("down_proj", e, h, y, spans)
        return y

    def _add_lora(self, weight: str, e: int, x: torch.Tensor, out: torch.Tensor,
                  spans: list[tuple[int, int, int]]) -> None:
        """Adds, in place, each span's adapter's delta of expert `e`'s matrix of `weight`: (x A_e^T) B_e^T."""
        adapters = self.lora.get(weight)
        if adapters is None:
            return
        for slot, first, end in spans:
            pair = adapters[slot]
            if pair is not None:
                out[first:end].addmm_(x[first:end] @ pair[0][e].t(), pair[1][e].t())

    def _token_slots(self, n: int, device: torch.device) -> torch.Tensor | None:
        """Each of the pass's n rows' LoRA slot (-1: none), or None when no adapter of these weights runs."""
        groups = [(slot, rows) for slot, rows in active_rows()
                  if any(adapters[slot] is not None for adapters in self.lora.values())]
        if not groups:
            return None
        slots = torch.full((n,), -1, dtype=torch.long, device=device)
        for slot, rows in groups:
            for part in (slice(0, n),) if rows is None else rows:
                slots[part] = slot
        return slots

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """experts, weights: [T, k] -> sum over k of weight * expert(x)."""
        token_slots = self._token_slots(x.shape[0], x.device) if self.lora else None
        if token_slots is None and self.packed is None and fused_moe_wanted(x):  # CUDA: two grouped GEMMs
            return triton_moe_kernels().fused_experts(x, experts, weights, self.gate_up_proj, self.down_proj,
                                                      self.act)
        if static_shapes_active():
            if token_slots is not None:  # graphs are off with LoRA (vlserve.engine.config): never reached
                raise RuntimeError("LoRA adapters of MoE experts cannot run in a captured graph")
            if experts.numel() <= self.num_experts and self.packed is None:
                return self._gathered(x, experts, weights)
            return self._every_expert(x, experts, weights)
        k = experts.shape[1]
        flat = experts.reshape(-1)  # [T*k], token t's slots at t*k .. t*k+k-1
        # With adapters: sorted by (expert, LoRA slot), so each expert's rows of one adapter are one span, all
        # counted with one host sync (never one per expert).
        kinds = 1 if token_slots is None else len(next(iter(self.lora.values()))) + 1  # no adapter, slot 0, ...
        key = flat if token_slots is None else flat * kinds + (token_slots + 1).repeat_interleave(k)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.num_experts * kinds).tolist()
        tokens = order // k
        out = torch.zeros_like(x)
        start = 0
        for e in range(self.num_experts):  # experts in ascending order, like the reference's accumulation
            per_slot = counts[e * kinds : (e + 1) * kinds]
            n = sum(per_slot)
            if n == 0:
                continue
            slots = order[start : start + n]
            rows = tokens[start : start + n]
            start += n
            spans, first = [], 0
            for kind, count in enumerate(per_slot):
                if kind and count:
                    spans.append((kind - 1, first, first + count))
                first += count
            y = self._expert(e, x[rows], spans)
            out.index_add_(0, rows, y * weights.reshape(-1)[slots, None])
        return out

    def _gathered(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Static shapes, few pairs: each (token, expert) pair multiplies its expert's weights, gathered."""
        T, k = experts.shape
        order = torch.argsort(experts, dim=1)  # each token's experts in ascending order, like the reference's sum
        experts, weights = experts.gather(1, order), weights.gather(1, order)
        flat = experts.reshape(-1)
        rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        gate, up = torch.bmm(self.gate_up_proj[flat], rows).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[flat], (self.act(gate) * up).unsqueeze(-1)).squeeze(-1)  # [T*k, H]
        y = (y * weights.reshape(-1, 1)).view(T, k, -1)
        out = y[:, 0]
        for j in range(1, k):
            out = out + y[:, j]
        return out

    def _every_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Static shapes, many pairs: every expert runs on every token; a token's weight for an expert it did not
        choose is 0, so adding that expert's product leaves its sum as it was."""
        dense = x.new_zeros(x.shape[0], self.num_experts).scatter_(1, experts, weights)  # [T, E]
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            w = dense[:, e : e + 1]
            out = out + torch.where(w != 0, self._expert(e, x) * w, 0)  # an inf an unchosen expert made stays out
        return out
