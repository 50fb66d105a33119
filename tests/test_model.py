"""What a gateway receives: requests that hold the conversation without copying it."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest

from asiento import Agent, MemoryCheckpointer, ModelRequest, ModelResponse, Session, ToolCall, tool
from asiento.model import ConversationPrefix, Message
from asiento.testing import ScriptedGateway


def _messages(n: int) -> list[Message]:
    return [Message(role="user", content=f"m{i}") for i in range(n)]


def test_a_prefix_is_the_first_messages_and_stays_so() -> None:
    """Messages appended to the list after the request was made are not in it."""
    items = _messages(3)
    prefix = ConversationPrefix(items, 2)
    items.append(Message(role="assistant", content="later"))
    assert len(prefix) == 2
    assert list(prefix) == items[:2]
    assert prefix[-1] is items[1]
    assert prefix[0:5] == tuple(items[:2])
    assert items[2] not in prefix
    with pytest.raises(IndexError):
        prefix[2]


def test_a_prefix_equals_hashes_pickles_and_prints_as_its_tuple() -> None:
    items = _messages(4)
    prefix, frozen = ConversationPrefix(items, 3), tuple(items[:3])
    assert prefix == frozen
    assert frozen == prefix
    assert prefix != tuple(items)
    assert ModelRequest(messages=prefix) == ModelRequest(messages=frozen)
    assert hash(ModelRequest(messages=prefix)) == hash(ModelRequest(messages=frozen))
    assert pickle.loads(pickle.dumps(prefix)) == frozen
    assert copy.deepcopy(ModelRequest(messages=prefix)) == ModelRequest(messages=frozen)
    assert repr(prefix) == repr(frozen)


def test_a_prefix_concatenates_into_a_tuple_as_the_tuple_did() -> None:
    """Gateways written when ``messages`` was a tuple may add to it."""
    items = _messages(3)
    prefix, extra = ConversationPrefix(items, 2), Message(role="user", content="more")
    assert prefix + (extra,) == (items[0], items[1], extra)  # noqa: RUF005
    assert prefix + [extra] == (items[0], items[1], extra)  # noqa: RUF005
    assert (extra,) + prefix == (extra, items[0], items[1])  # noqa: RUF005
    assert prefix + prefix == (items[0], items[1], items[0], items[1])
    with pytest.raises(TypeError):
        prefix + "text"  # type: ignore[operator]


def test_other_sequences_are_still_copied_into_a_tuple() -> None:
    items = _messages(2)
    request = ModelRequest(messages=items)
    items.append(Message(role="user", content="later"))
    assert request.messages == tuple(items[:2])
    assert isinstance(request.messages, tuple)


@tool(idempotent=True)
async def count(n: int) -> str:
    """Count."""
    return str(n)


def _counting(request: ModelRequest) -> ModelResponse:
    done = (len(request.messages) - 1) // 2
    if done < 400:
        return ModelResponse(tool_calls=[ToolCall(name="count", arguments={"n": done})])
    return ModelResponse(text="counted")


async def test_requests_kept_by_a_gateway_cost_memory_in_proportion_to_the_run() -> None:
    """A gateway that keeps every request of a 400-step run keeps each message once.

    With a copy of the conversation in each request, the 401 requests would
    hold 401 x 400 message references (about 1.3 MB); they share the agent's list.
    """
    gateway = ScriptedGateway(_counting)
    agent = Agent(tools=[count], max_turns=401)
    async for _ in agent.run("count", session=Session("r", gateway, MemoryCheckpointer())):
        pass
    assert len(gateway.calls) == 401
    lengths = [len(request.messages) for request, _ in gateway.calls]
    assert lengths == [1 + 2 * turn for turn in range(401)]  # each one as it was sent
    assert gateway.calls[3][0].messages[-1].content == "2"
    held = sum(sys.getsizeof(request.messages) for request, _ in gateway.calls)
    assert held < 100_000, f"the requests' message sequences take {held:,} bytes"
