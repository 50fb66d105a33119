"""A LangGraph model step's request fingerprint, as a pass computes it from what it
hashed before: always the one hashed from scratch, whatever the pass kept."""

from __future__ import annotations

from typing import Any

from langchain_core.load import dumpd
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolMessage

from asiento._canonical import fingerprint
from asiento.integrations._langgraph_digests import (
    Digests,
    dumped_digest,
    jsonable,
    request_fingerprint,
)

from .langgraph_graph import ScriptedChat


def _scratch(model: Any, prompt: list[BaseMessage]) -> str:
    """The fingerprint with nothing kept: every message dumped and hashed."""
    return request_fingerprint(model, prompt, None, {}, Digests())


def _answer(turn: int) -> AIMessage:
    call = {"name": "lookup", "args": {"order": turn}, "id": f"call-{turn}"}
    return AIMessage(content="", tool_calls=[call])


def test_fingerprint_is_the_canonical_hash_of_the_digests() -> None:
    """The running hash gives the fingerprint of the digests' canonical JSON, as recorded."""
    model, digests = ScriptedChat(), Digests()
    prompt: list[BaseMessage] = [SystemMessage(content="You refund orders.")]
    fp = request_fingerprint(model, prompt, None, {}, digests)
    messages = [dumped_digest(dumpd(m)) for m in prompt]
    params = next(digest for _, digest in digests.params.values())
    assert fp == fingerprint({"messages": messages, "params": params})


def test_a_growing_conversation_hashes_as_from_scratch() -> None:
    """Each step's fingerprint equals the one hashed from scratch, as the prompt grows,
    begins with a system prompt built afresh, or is cut short."""
    model, digests = ScriptedChat(), Digests()
    state: list[BaseMessage] = []
    for turn in range(4):
        prompt = [SystemMessage(content="You refund orders."), *state]
        assert request_fingerprint(model, prompt, None, {}, digests) == _scratch(model, prompt)
        state += [_answer(turn), ToolMessage(content=f"order {turn}", tool_call_id=f"call-{turn}")]
    shorter = [SystemMessage(content="You refund orders."), *state[:2]]
    assert request_fingerprint(model, shorter, None, {}, digests) == _scratch(model, shorter)


def test_a_seeded_answer_changed_in_place_is_hashed_again() -> None:
    """An answer dumped for its record and changed before the next prompt is hashed as it
    is now, not as it was recorded; unchanged (but for its id), it hashes the same."""
    model, digests = ScriptedChat(), Digests()
    kept, changed = _answer(1), _answer(2)
    digests.seed(kept, dumpd(kept))
    digests.seed(changed, dumpd(changed))
    kept.id = "given-by-langgraph"
    changed.tool_calls[0]["args"]["order"] = 3
    prompt: list[BaseMessage] = [kept, changed]
    assert request_fingerprint(model, prompt, None, {}, digests) == _scratch(model, prompt)


def test_jsonable_keeps_what_json_has_and_names_the_rest() -> None:
    """Plain values kept, keys made text, tuples lists, anything else its repr."""
    assert jsonable({"a": (1, [2.5, None]), 3: True, "o": object}) == {
        "a": [1, [2.5, None]],
        "3": True,
        "o": repr(object),
    }
