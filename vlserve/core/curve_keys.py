"""CurveZMQ key pairs derived from a shared secret, so that peers that hold the secret know each other's keys
without exchanging them (the disaggregated roles' data channel, tensor-parallel ranks on several machines)."""

from __future__ import annotations

import hashlib

import zmq
from zmq.utils import z85


def curve_keypair(secret: str, purpose: str) -> tuple[bytes, bytes]:
    """(public, secret) Curve25519 keys in Z85, derived from `secret`; `purpose` (<= 16 bytes used) tells the
    pairs of one secret apart."""
    seed = hashlib.blake2b(secret.encode(), digest_size=32, person=purpose.encode()[:16]).digest()
    private = z85.encode(seed)
    return zmq.curve_public(private), private
