"""Marks forward passes that must keep their shapes and never read a device value on the host: those captured
as a graph (and, on a CPU, the same passes replayed eagerly). Layers with a faster data-dependent path (the MoE
layer's per-expert grouping reads token counts) take their static path while it is on."""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def active() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def static_shapes():
    before = active()
    _state.on = True
    try:
        yield
    finally:
        _state.on = before
