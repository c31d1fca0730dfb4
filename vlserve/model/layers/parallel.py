"""Tensor parallelism in the model code: this process's rank, the collectives, and how each rank's share of a
checkpoint tensor is cut.

Megatron-style splits. A column-parallel linear keeps a slice of the output features (whole attention heads,
MLP columns) and needs no communication; the row-parallel linear after it keeps the matching input features and
its partial sums are all-reduced. The embedding and the LM head keep a slice of the vocabulary.

Layers stay plain `nn.Linear` / `nn.Embedding`-shaped modules with their *local* shapes, so oneDNN packing,
int8 quantization and the loader treat them as always. A split layer records how (`tp_rules`: parameter name ->
rule) and the loader asks the rule for this rank's part of each checkpoint tensor. At one rank every rule keeps
the whole tensor and every collective returns at once: the single-device model is this same code.

Models read the group they are built for from `current_tp()` (set around construction with `building_for`), and
keep it: the vision tower of `--mm-encoder-tp-mode data` is built for a single rank inside a tensor-parallel LM.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from vlserve.core.errors import InvalidInputError


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group
    local: Any = None  # ShmCollectives when every rank is on this machine (CPU tensors go through it)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size == 1:
            return x
        if self.local is not None and x.device.type == "cpu":
            return self.local.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `x` (same shapes) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        if self.local is not None and x.device.type == "cpu":
            return self.local.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()
_current = SINGLE


def current_tp() -> TPGroup:
    return _current


@contextmanager
def building_for(group: TPGroup):
    """Modules constructed inside take `group` as their tensor-parallel group."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


# ---- how a dimension is split ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """This rank's rows [start, start + size) of a dimension `full` long."""

    full: int
    start: int
    size: int


def even_split(full: int, tp: TPGroup, what: str) -> Split:
    if full % tp.size:
        raise InvalidInputError(f"tensor parallelism: {what} ({full}) is not divisible by "
                                f"tensor_parallel_size {tp.size}")
    size = full // tp.size
    return Split(full, tp.rank * size, size)


def head_split(num_heads: int, head_dim: int, tp: TPGroup, what: str, copies: bool = False) -> Split:
    """Whole heads per rank. `copies` (GQA key/value heads): with fewer heads than ranks each rank keeps a copy
    of the head its query heads use, which needs the rank count to be a multiple of the head count. Heads whose
    outputs are summed over ranks (query heads) are never copied: they would count twice."""
    if num_heads >= tp.size or not copies:
        heads = even_split(num_heads, tp, what)
        return Split(num_heads * head_dim, heads.start * head_dim, heads.size * head_dim)
    if tp.size % num_heads:
        raise InvalidInputError(f"tensor parallelism: {num_heads} {what} cannot be shared evenly by "
                                f"tensor_parallel_size {tp.size}")
    head = tp.rank * num_heads // tp.size
    return Split(num_heads * head_dim, head * head_dim, head_dim)


def padded_split(full: int, tp: TPGroup) -> Split:
    """Equal slices (the last one padded past `full`): for the vocabulary, whatever its size."""
    size = -(-full // tp.size)
    return Split(full, tp.rank * size, size)


# ---- rules: this rank's part of a checkpoint tensor ---------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """Output features along `dim`, possibly several fused pieces (q/k/v, gate/up), each split on its own."""

    pieces: dict[str, Split]
    dim: int = 0

    def local(self, tensor: torch.Tensor, piece: str | None) -> torch.Tensor:
        if piece is not None:  # the checkpoint stores this piece alone
            s = self.pieces[piece]
            return tensor.narrow(self.dim, s.start, s.size) if tensor.shape[self.dim] == s.full else tensor
        splits = list(self.pieces.values())
        if all(s.size == s.full for s in splits):
            return tensor  # one rank: the whole tensor, no copy
        if tensor.dim() <= self.dim or tensor.shape[self.dim] != sum(s.full for s in splits):
            return tensor  # not what this layer holds: the loader's shape check says so
        parts = tensor.split([s.full for s in splits], self.dim)  # a fused tensor: split each piece on its own
        return torch.cat([p.narrow(self.dim, s.start, s.size) for p, s in zip(parts, splits)], self.dim)

    def full_shape(self, shape: torch.Size) -> torch.Size:
        return _with(shape, self.dim, sum(s.full for s in self.pieces.values()))


@dataclass(frozen=True)
class Row:
    """Input features along `dim`."""

    split: Split
    dim: int = 1

    def local(self, tensor: torch.Tensor, piece: str | None) -> torch.Tensor:
        if tensor.dim() <= self.dim or tensor.shape[self.dim] != self.split.full:
            return tensor  # not what this layer holds: the loader's shape check says so
        return tensor.narrow(self.dim, self.split.start, self.split.size)

    def full_shape(self, shape: torch.Size) -> torch.Size:
        return _with(shape, self.dim, self.split.full)


@dataclass(frozen=True)
class OnFirstRank:
    """A row-parallel layer's bias: added once, by rank 0, before the partial sums are reduced."""

    rank: int

    def local(self, tensor: torch.Tensor, piece: str | None) -> torch.Tensor:
        return tensor if self.rank == 0 else torch.zeros_like(tensor)

    def full_shape(self, shape: torch.Size) -> torch.Size:
        return shape


@dataclass(frozen=True)
class Vocab:
    """Rows of the vocabulary; the last rank's slice is padded with zero rows."""

    split: Split

    def local(self, tensor: torch.Tensor, piece: str | None) -> torch.Tensor:
        s = self.split
        if tensor.shape[0] != s.full:
            return tensor  # not what this layer holds: the loader's shape check says so
        part = tensor[s.start : min(s.start + s.size, s.full)]
        if part.shape[0] == s.size:
            return part
        return torch.cat([part, part.new_zeros(s.size - part.shape[0], *part.shape[1:])])

    def full_shape(self, shape: torch.Size) -> torch.Size:
        return _with(shape, 0, self.split.full)


def _with(shape: torch.Size, dim: int, size: int) -> torch.Size:
    dims = list(shape)
    dims[dim] = size
    return torch.Size(dims)


def rule_for(model: nn.Module, name: str):
    """The rule cutting parameter `name` (dotted, from the model root), or None when every rank keeps it whole."""
    owner, _, param = name.rpartition(".")
    rules = getattr(model.get_submodule(owner), "tp_rules", None) if owner else None
    return rules.get(param) if rules else None


# ---- layers ---------------------------------------------------------------------------------------------------
def column_linear(in_features: int, pieces: dict[str, Split], bias: bool) -> nn.Linear:
    linear = nn.Linear(in_features, sum(s.size for s in pieces.values()), bias=bias)
    linear.tp_rules = {"weight": Column(pieces), "bias": Column(pieces)}
    return linear


def row_linear(split: Split, out_features: int, bias: bool, tp: TPGroup) -> nn.Linear:
    linear = nn.Linear(split.size, out_features, bias=bias)
    linear.tp_rules = {"weight": Row(split), "bias": OnFirstRank(tp.rank)}
    return linear


class VocabEmbedding(nn.Module):
    """`nn.Embedding` over this rank's slice of the vocabulary: ids outside it give zero rows, and the ranks'
    rows are summed (exactly one rank contributes a non-zero row per id)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.split = padded_split(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.split.size, dim))
        self.tp_rules = {"weight": Vocab(self.split)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.split.start
        outside = (local < 0) | (local >= self.split.size)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


def vocab_head(hidden: int, vocab_size: int, tp: TPGroup) -> nn.Linear:
    split = padded_split(vocab_size, tp)
    head = nn.Linear(hidden, split.size, bias=False)
    head.tp_rules = {"weight": Vocab(split)}
    return head
