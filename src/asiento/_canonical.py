"""Canonical JSON and the hashes built on it.

Canonical means sorted keys and no spaces, exactly as the seed writes it, so a
hash never depends on the order a dict was built in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel


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


def unstable_part(value: Any, name: str = "value") -> str | None:
    """What in ``value`` has no canonical JSON, named by its path; None if nothing.

    A set has no stable order (its JSON would differ between processes); a value
    that contains itself has no JSON at all. The walk keeps a stack of its own, so a
    cycle is named (``value['a'][0] is value``) where an encoder's recursion would
    only overflow. Dicts, lists, tuples, dataclasses and pydantic models are walked.
    """
    on_path: dict[int, _Crumb | None] = {}
    stack: list[tuple[Any, _Crumb | None, bool]] = [(value, None, True)]
    while stack:
        node, crumb, entering = stack.pop()
        if not entering:
            del on_path[id(node)]
        elif isinstance(node, set | frozenset):
            return f"{_path(name, crumb)} is a set, which has no stable order: return a sorted list"
        elif (parts := _parts(node)) is not None:
            if id(node) in on_path:
                again = _path(name, on_path[id(node)])
                return f"{_path(name, crumb)} is {again} itself: a reference cycle"
            on_path[id(node)] = crumb
            stack.append((node, crumb, False))
            stack.extend(
                (part, (crumb, key), True) for key, part in parts if type(part) not in _LEAVES
            )
    return None


class _Field(str):
    """A step into a dataclass or model field (``.name``), beside keys and indexes (``[k]``)."""


# A path as a chain of steps back to the root, put into words only when it is reported
# (so that the walk down a deep value stays linear).
_Crumb = tuple[Any, Any]

_LEAVES = frozenset({str, int, float, bool, type(None)})


def _path(name: str, crumb: _Crumb | None) -> str:
    steps = []
    while crumb is not None:
        crumb, key = crumb
        steps.append(f".{key}" if type(key) is _Field else f"[{key!r}]")
    return name + "".join(reversed(steps))


def _parts(node: Any) -> Iterable[tuple[Any, Any]] | None:
    """The (key, part) pairs of a container; None for a value that holds none."""
    if isinstance(node, dict):
        return node.items()
    if isinstance(node, list | tuple):
        return enumerate(node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(_Field(f.name), getattr(node, f.name)) for f in dataclasses.fields(node)]
    if isinstance(node, BaseModel):
        return [(_Field(key), part) for key, part in vars(node).items()]
    return None


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


def model_key(run_id: str, step_id: str, request_fingerprint: str) -> str:
    """The idempotency key of a model request: (run_id, step_id, body fingerprint)."""
    return f"{run_id}:{step_id}:{request_fingerprint[:32]}"


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
