"""Which rows of the current forward pass take which LoRA adapter slot (vlserve.lora puts the adapters there).

The engine sets this around a forward pass (the language model's tokens, or one tower call whose items share an
adapter); every `LoRALinear`, and every MoE experts module with adapters, reads it. A group is (slot, rows): rows
a tuple of row ranges (slices) of the pass, or None for all of them. The runner orders a step's rows by adapter,
so an adapter's rows are one or two ranges and each linear adds its delta range by range, in place. One thread
runs the model: a module-level value is enough."""

from __future__ import annotations

from contextlib import contextmanager

Rows = tuple[slice, ...] | None
_active: tuple[tuple[int, Rows], ...] = ()


def active_rows() -> tuple[tuple[int, Rows], ...]:
    return _active


@contextmanager
def lora_rows(groups: tuple[tuple[int, Rows], ...]):
    global _active
    previous, _active = _active, tuple(groups)
    try:
        yield
    finally:
        _active = previous


@contextmanager
def rows_between(start: int, end: int):
    """Inside: the groups of rows [start, end) only, numbered from 0: a row-wise function run on a slice of the
    pass's rows (vlserve.model.layers.mlp.in_row_slices) adds each adapter's delta to the right rows."""
    global _active
    previous = _active
    if previous:
        _active = tuple(g for g in (_restrict(slot, rows, start, end) for slot, rows in previous) if g is not None)
    try:
        yield
    finally:
        _active = previous


def _restrict(slot: int, rows: Rows, start: int, end: int) -> tuple[int, Rows] | None:
    if rows is None:
        return slot, None
    inside = []
    for part in rows:
        lo, hi = max(part.start, start) - start, min(part.stop, end) - start
        if lo < hi:
            inside.append(slice(lo, hi))
    if not inside:
        return None
    return slot, None if inside == [slice(0, end - start)] else tuple(inside)


def row_groups(slots: list[int | None], counts: list[int]) -> tuple[tuple[int, Rows], ...]:
    """Groups of a batch whose consecutive runs of `counts[i]` rows take adapter slot `slots[i]` (None: no
    adapter); adjacent runs of one slot merge into one range, and a slot with every row gets None."""
    total = sum(counts)
    spans: dict[int, list[list[int]]] = {}
    row = 0
    for slot, n in zip(slots, counts):
        if slot is not None and n:
            parts = spans.setdefault(slot, [])
            if parts and parts[-1][1] == row:
                parts[-1][1] = row + n
            else:
                parts.append([row, row + n])
        row += n
    return tuple((slot, None if parts == [[0, total]] else tuple(slice(lo, hi) for lo, hi in parts))
                 for slot, parts in spans.items())
