"""Canonical JSON and the hashes built on it.

Canonical means sorted keys and no spaces, exactly as the seed writes it, so a
hash never depends on the order a dict was built in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote


def compact_encoder(*, sort_keys: bool) -> Callable[[Any], str]:
    """``json.dumps(obj, separators=(",", ":"), allow_nan=False, sort_keys=...)``, faster.

    Every step serialises a few small objects; ``json.dumps`` builds a new encoder
    (in Python, then in C) each time. This builds CPython's C encoder once and
    reuses it, when it is there and gives the same text as ``json.dumps``; else
    it reuses one ``JSONEncoder``. A reference cycle raises ``RecursionError``
    (``json.dumps`` would raise ``ValueError``): both callers treat either as "not JSON".
    """
    encoder = json.JSONEncoder(sort_keys=sort_keys, separators=(",", ":"), allow_nan=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    try:
        c_encode = make(
            None, encoder.default, json.encoder.encode_basestring_ascii, None,
            ":", ",", sort_keys, False, False,
        )  # fmt: skip

        def encode(obj: Any) -> str:
            return "".join(c_encode(obj, 0))

        probe = {"b": [1, 2.5, None, True, "é\n"], "a": {"y": "", "x": -0.0}}
        if encode(probe) == encoder.encode(probe):
            return encode
    except Exception:  # another Python's private encoder: the public one is right too
        pass
    return encoder.encode


_CANONICAL = compact_encoder(sort_keys=True)


def canonical_json(obj: Any) -> str:
    """Serialise ``obj`` so that equal values give equal text."""
    return _CANONICAL(obj)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(obj: Any) -> str:
    """The sha256 of the canonical JSON of ``obj``."""
    return sha256_hex(canonical_json(obj))


def idem_key(run_id: str, step_id: str, params: Any, *, n: int = 6) -> str:
    """Deterministic idempotency key: stable across restarts, unique across tasks.

    ``f"{run_id}:{step_id}:{sha256(canonical JSON of params)[:n]}"`` as in the seed.
    """
    return f"{run_id}:{step_id}:{fingerprint(params)[:n]}"


class FingerprintChain:
    """A running hash of a conversation: each step hashes only what was added.

    The cost of a step stays flat however long the run grows, where hashing the
    whole conversation at every step would grow with it.
    """

    __slots__ = ("value",)

    def __init__(self, head: Any) -> None:
        self.value = fingerprint(head)

    def add(self, item: Any) -> str:
        self.value = sha256_hex(self.value + canonical_json(item))
        return self.value


def key_header(idempotency_key: str) -> dict[str, str]:
    """The ``Idempotency-Key`` header; a key outside plain ASCII is percent-encoded.

    HTTP header values cannot carry arbitrary Unicode or line breaks, and the
    encoding is deterministic, so a resumed process sends the very same header.
    """
    return {"Idempotency-Key": quote(idempotency_key, safe="!#$&'()*+,./:;=?@[]^_`{|}~-")}
