"""What a LangGraph model step asks, hashed: the request fingerprint its record keeps.

A step's fingerprint hashes each message of the prompt (LangChain's ``dumpd`` of it,
without the id LangGraph gives it), the model's invocation parameters (model name,
settings, bound tools) and ``stop``. ``dumpd`` is most of what a step costs asiento,
so a pass keeps what it hashed (``Digests``) and a step hashes only what is new:

- a message LangGraph's state hands on from step to step: by the object;
- a message a node builds afresh at each step (its system prompt), or the answer this
  pass just dumped for its record: by its content, the exact bytes of its fields
  (``pickle``), so a message changed in place since is hashed again, never mistaken;
- the parameters: by the model and its bound arguments (the same objects at each call
  of a bound model);
- the fingerprint itself: the canonical JSON of the digests, hashed on from the last
  prompt's when this one begins with it (a conversation that grows), so a step's cost
  stays flat however long the run.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.load import dumpd
from langchain_core.messages import BaseMessage

from .._canonical import fingerprint

# The canonical JSON of a request's fingerprint, up to its first message digest: the
# digests are hexadecimal text, so each is written as is, in quotes (no escaping).
_HEAD = b'{"messages":['
# Invocation parameters that say how a request travels or who traces it, not what it asks.
_TRANSPORT = frozenset({"extra_headers", "timeout", "request_timeout", "max_retries", "stream"})


class Digests:
    """The digests one pass computed: of messages, by object and by content, and of
    the model's parameters. Each object a key stands for is kept, so its id is not reused."""

    def __init__(self) -> None:
        self.by_object: dict[int, tuple[BaseMessage, str]] = {}
        self.by_content: dict[tuple[type, bytes], str] = {}
        self.params: dict[Any, tuple[Any, str]] = {}
        # The last prompt's message digests, and the sha256 of its fingerprint's text
        # up to the end of their list (its closing bracket not yet written).
        self.last: tuple[list[str], Any] = ([], hashlib.sha256(_HEAD))

    def message(self, message: BaseMessage) -> str:
        known = self.by_object.get(id(message))
        if known is not None and known[0] is message:
            return known[1]
        key = _content_key(message)
        digest = None if key is None else self.by_content.get(key)
        if digest is None:
            digest = dumped_digest(dumpd(message))
            if key is not None:
                self.by_content[key] = digest
        self.by_object[id(message)] = (message, digest)
        return digest

    def hashed(self, messages: list[str], params: str) -> str:
        """``fingerprint({"messages": messages, "params": params})``, hashing only the
        digests after the last prompt's when ``messages`` begins with them."""
        before, state = self.last
        if messages[: len(before)] != before:
            before, state = [], hashlib.sha256(_HEAD)
        state = state.copy()
        for n, digest in enumerate(messages[len(before) :], len(before)):
            state.update(b'%s"%s"' % (b"," if n else b"", digest.encode()))
        self.last = (messages, state)
        closed = state.copy()
        closed.update(b'],"params":"%s"}' % params.encode())
        return str(closed.hexdigest())

    def seed(self, message: BaseMessage, dumped: Any) -> None:
        """``message`` was just dumped (``dumped``) for a record: its digest, found again
        by content when it is in a prompt unchanged."""
        key = _content_key(message)
        if key is not None and key not in self.by_content:
            self.by_content[key] = dumped_digest(dumped)


def request_fingerprint(
    model: BaseChatModel,
    prompt: Sequence[BaseMessage],
    stop: list[str] | None,
    kwargs: Mapping[str, Any],
    digests: Digests | None = None,
) -> str:
    """What the step asks the model, hashed (the module's docstring says what is in it)."""
    known = Digests() if digests is None else digests
    messages = [known.message(m) for m in prompt]
    return known.hashed(messages, _params_digest(model, stop, kwargs, known))


def _params_digest(
    model: BaseChatModel, stop: list[str] | None, kwargs: Mapping[str, Any], digests: Digests
) -> str:
    held = (model, tuple(stop or ()), tuple(kwargs.items()))
    key = (id(model), held[1], tuple((k, id(v)) for k, v in kwargs.items()))
    known = digests.params.get(key)
    if known is not None and known[0][0] is model:
        return str(known[1])
    params = model._get_invocation_params(stop=stop, **dict(kwargs))
    kept = {k: v for k, v in params.items() if k not in _TRANSPORT}
    digest = fingerprint(jsonable(kept))
    digests.params[key] = (held, digest)
    return digest


def dumped_digest(dumped: Any) -> str:
    """The digest of a message from its ``dumpd``: without the id LangGraph gives it."""
    return fingerprint(jsonable(_without_ids(dumped)))


def _content_key(message: BaseMessage) -> tuple[type, bytes] | None:
    """The message's class and the bytes of its fields but its id (``dumpd`` reads only
    those); None if a field cannot be pickled (then it is found by object only)."""
    fields = {k: v for k, v in message.__dict__.items() if k != "id"}
    try:
        return type(message), pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # any field's own pickling may fail in its own way
        return None


def _without_ids(dumped: Any) -> Any:
    if isinstance(dumped, dict):
        kwargs = dumped.get("kwargs")
        if isinstance(kwargs, dict):
            return dumped | {"kwargs": {k: v for k, v in kwargs.items() if k != "id"}}
    return dumped


_PLAIN = frozenset({str, int, float, bool, type(None)})


def jsonable(value: Any) -> Any:
    """``value`` as JSON: mappings with text keys, lists, plain values, anything else its repr."""
    kind = type(value)  # the exact types first: a message's dump holds only those
    if kind in _PLAIN:
        return value
    if kind is dict:
        return {k if type(k) is str else str(k): jsonable(v) for k, v in value.items()}
    if kind is list:
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)
