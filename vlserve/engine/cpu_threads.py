"""Torch's CPU threads for a process that runs (part of) the model, from the CPU budget (core/cpu_budget.py).

Without this torch starts one thread per core of the affinity mask, however small the cgroup's CPU quota.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vlserve.core.cpu_budget import ThreadPlan, plan_threads

logger = logging.getLogger("vlserve.hardware")  # beside the `hardware:` line


def apply_cpu_threads(cpu_threads: int | None = None, ranks: int = 1, media_pool: int | None = None,
                      plan: ThreadPlan | None = None) -> Callable[[], None]:
    """Sets torch's intra-op threads of this process (`ranks`: tensor-parallel ranks sharing the budget) and logs
    the one `CPU budget:` line; returns the undo (an in-process engine gives the threads back at shutdown)."""
    plan = plan or plan_threads(cpu_threads, ranks)
    before = torch.get_num_threads()
    if plan.torch_threads != before:
        torch.set_num_threads(plan.torch_threads)
    logger.info("%s", plan.describe(media_pool))
    return lambda: torch.set_num_threads(before)
