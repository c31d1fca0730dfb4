"""The ranks that run a model for one process: the whole model here (one device), or rank 0 here and the others
in their own processes (tensor parallelism). Shared by the engine and the encode service."""

from __future__ import annotations

from vlserve.engine.config import DATA, VlserveConfig
from vlserve.engine.model_shard import ModelShard, load_shard
from vlserve.engine.tp.leader import TPLeader


def start_executor(cfg: VlserveConfig) -> ModelShard | TPLeader:
    """Loads the model (vision tower, language model or both, per `cfg`) over `cfg.tensor_parallel_size` ranks."""
    return TPLeader.start(cfg) if cfg.tensor_parallel_size > 1 else load_shard(cfg)


def encodes_whole_step(executor: ModelShard | TPLeader) -> bool:
    """The data-parallel encoder spreads a step's pictures over its ranks: give it every picture in one call."""
    return executor.encoder_mode == DATA and executor.tp.size > 1
