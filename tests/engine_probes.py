"""What engine tests watch from outside: the chunks the scheduler plans and how the engine's metrics moved."""

from __future__ import annotations

from vlserve import LLM


def metric_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def record_chunks(llm: LLM, preempted: list | None = None) -> list[tuple[list, int, int]]:
    """Wrap the scheduler: collects (the request's media items, first token, end) of every scheduled chunk, and
    into `preempted` the media items of every preempted request."""
    sched = llm.engine.core.scheduler
    seen: list[tuple[list, int, int]] = []
    orig = sched.schedule

    def schedule():
        out = orig()
        seen.extend((c.req.mm_items, c.start, c.end) for c in out.chunks)
        if preempted is not None:
            preempted.extend(sched.requests[rid].mm_items for rid in out.preempted)
        return out

    sched.schedule = schedule
    return seen
