"""The two kinds of peer a receiving server talks to, and what each kind's requests are keyed by when picking one.

- Encoders (`ENCODER_PEERS`) send embedding rows of media tokens. Their cache is keyed by content (mm_hash), so a
  request is keyed by the content of its media where this server can know it without fetching anything: a data
  URL's decoded bytes, an id the client gave the item (`multi_modal_uuids`), precomputed embeddings; else the URL
  as sent.
- Prefill instances (`PREFILL_PEERS`) send every prompt token's KV row. Their prefix cache holds what prompts
  share from the start, so a request is keyed by its prompt's first `PREFIX_KEY_CHARS` characters (and its
  media's content keys, which the text shows only as placeholders): a repeated prompt (or one behind the same
  long system prompt) finds the instance that has it cached, and different prompts spread.

A key picks its peer by rendezvous hashing (`rendezvous_score`): every key has an order of preference over the
peers, so when a peer comes or goes only the keys it won move. The load rule stays the receiver's
(`PeerClient._pick`).
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3

from vlserve.core.config import DisaggArgs
from vlserve.core.errors import VlserveError
from vlserve.engine.state_rows import state_row_count
from vlserve.frontend.config import FrontendConfig
from vlserve.media.data_url import decode_base64

# About the first 8 KV blocks of text (16 tokens a block, ~4 characters a token): what a shared system prompt or
# document fills, short enough that prompts differing early spread.
PREFIX_KEY_CHARS = 512
INLINE_KEY_CHARS = 1 << 20  # media text beyond this is hashed off the event loop (see `key_is_costly`)


@dataclass(frozen=True)
class PeerKind:
    role: str  # the peers' role in the registry
    name: str  # in messages
    rows_for_every_token: bool  # KV rows for every prompt token, not embedding rows for media tokens only

    def buffer_blocks(self, opts: DisaggArgs) -> int:
        """Blocks in this server's receive pool for what these peers send."""
        return opts.kv_buffer_blocks if self.rows_for_every_token else opts.media_buffer_blocks

    def allocate_rows(self, opts: DisaggArgs) -> int:
        """Receive rows reserved for a request before its peer says how many it needs."""
        return opts.kv_allocate_tokens if self.rows_for_every_token else opts.media_allocate_rows

    def expects(self, cfg: FrontendConfig) -> tuple:
        """What a peer's Pong must say to be paired: it produces exactly what this model needs."""
        m = cfg.model
        return (m.architecture, m.text.hidden_size, m.side_rows,
                m.kv_row_width if self.rows_for_every_token else 0, self.tail_rows(cfg))

    def tail_rows(self, cfg: FrontendConfig) -> int:
        """Rows after a prompt's token rows: a hybrid model's linear states, handed over with its KV."""
        return state_row_count(cfg.model, cfg.dtype) if self.rows_for_every_token and cfg.model.is_hybrid else 0

    def affinity_key(self, prompt: str, media: dict, uuids: dict) -> str:
        """What a request is keyed by when picking a peer: the same key goes to the same peer while it can."""
        if self.rows_for_every_token:
            return prompt_prefix_key(prompt, media_content_key(media, uuids) if media else "")
        return media_content_key(media, uuids)

    def key_is_costly(self, media: dict) -> bool:
        """Whether computing the key reads enough (large data URLs) to belong off the event loop."""
        return sum(len(src) for items in media.values() for src in items if isinstance(src, str)) > INLINE_KEY_CHARS


ENCODER_PEERS = PeerKind("encode", "encoder", rows_for_every_token=False)
PREFILL_PEERS = PeerKind("prefill", "prefill instance", rows_for_every_token=True)


def prompt_prefix_key(text: str, media_key: str = "") -> str:
    return blake3.blake3(f"prefix|{media_key}|{text[:PREFIX_KEY_CHARS]}".encode()).hexdigest(length=16)


def media_content_key(media: dict, uuids: dict) -> str:
    """One key over every item of the prompt, in order (the same pictures, however sent, give the same key)."""
    h = blake3.blake3()
    for kind in sorted(media):
        ids = uuids.get(kind) or []
        for i, src in enumerate(media[kind]):
            uuid = ids[i] if i < len(ids) else None
            h.update(f"{kind}|{_item_key(src, uuid)}|".encode())
    return h.hexdigest(length=16)


def _item_key(src, uuid) -> str:
    if isinstance(uuid, str) and uuid:  # the client names the content: its word is the key
        return blake3.blake3(f"uuid|{uuid}".encode()).hexdigest(length=16)
    h = blake3.blake3()
    if isinstance(src, str):
        payload = _data_url_bytes(src)
        h.update(b"bytes|" + payload if payload is not None else b"url|" + src.encode(errors="replace"))
    elif isinstance(src, dict):  # precomputed embeddings: base64 text, or a tensor from the Python API
        embeds = src.get("image_embeds")
        if isinstance(embeds, str):
            h.update(b"embeds|" + embeds.encode(errors="replace"))
        elif hasattr(embeds, "numpy"):
            h.update(f"embeds|{embeds.dtype}|{tuple(embeds.shape)}|".encode())
            h.update(embeds.detach().cpu().contiguous().view(-1).numpy().tobytes())
        else:
            h.update(repr(src)[:256].encode())
    else:
        h.update(repr(src)[:256].encode())
    return h.hexdigest(length=16)


def _data_url_bytes(url: str) -> bytes | None:
    """A data URL's decoded payload (whatever its media-type label, padding or alphabet), or None for a URL whose
    content is elsewhere (or a malformed one: the encoder refuses it)."""
    if not url.startswith("data:"):
        return None
    head, comma, data = url.partition(",")
    if not comma or not head.endswith(";base64"):
        return None
    try:
        return decode_base64(data)
    except VlserveError:
        return None


def rendezvous_score(key: str, peer_id: str) -> int:
    """The key's preference for this peer: the live peer with the highest score serves the key."""
    return int.from_bytes(blake3.blake3(f"{key}|{peer_id}".encode()).digest(length=8), "big")
