"""Book-keeping of encoder outputs held by the model runner, keyed per multimodal item.

The scheduler decides when an item is encoded and when its embeddings may be dropped; the runner only
stores tensors under the keys it is given. An entry lives while some request still needs it: from the step
its placeholder is first scheduled until the placeholder is fully computed (or the request leaves).
"""

from __future__ import annotations

from vlserve.engine.request import Request


def item_key(req: Request, index: int) -> str:
    return f"{req.request_id}#{index}"


class EncoderCacheManager:
    def __init__(self) -> None:
        self._holders: dict[str, set[str]] = {}  # key -> ids of requests that still need it

    def __contains__(self, key: str) -> bool:
        return key in self._holders

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, req: Request, index: int) -> str:
        key = item_key(req, index)
        self._holders.setdefault(key, set()).add(req.request_id)
        return key

    def release(self, req: Request, index: int) -> str | None:
        """Drop this request's claim; returns the key when nobody needs the entry any more."""
        key = item_key(req, index)
        holders = self._holders.get(key)
        if holders is None or req.request_id not in holders:
            return None
        holders.discard(req.request_id)
        if holders:
            return None
        del self._holders[key]
        return key

    def release_all(self, req: Request) -> list[str]:
        freed = (self.release(req, i) for i in range(len(req.mm_items)))
        return [k for k in freed if k is not None]
