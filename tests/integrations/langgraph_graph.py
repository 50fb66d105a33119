"""The graph the LangGraph tests drive: LangGraph's quick-start agent (a model node and a
``ToolNode``, looping until the model answers), with one effect tool that appends to an
fsynced ledger and one read-only tool, on any chat model.

``SCRIPT`` is what a scripted model answers at each turn (the number of AI messages
already in the conversation), as ``tests/providers/fake_servers.FakeProvider`` does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

TASK = "refund order 42 to ana"
# (text, [(tool, args)]) per turn
SCRIPT: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = [
    ("", [("lookup", {"order": 42})]),
    ("", [("refund", {"order": 42, "to": "ana"})]),
    ("refunded order 42 to ana", []),
]


def ledger_line(path: Path, line: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def make_tools(ledger: Path) -> list[BaseTool]:
    @tool
    def lookup(order: int) -> str:
        """Look an order up (read-only)."""
        ledger_line(ledger, f"lookup {order}")
        return f"order {order}: 30 EUR, paid by ana"

    @tool
    def refund(order: int, to: str) -> str:
        """Refund an order (an effect: once)."""
        ledger_line(ledger, f"refund {order} {to}")
        return f"refund of order {order} to {to} issued"

    return [lookup, refund]


ASKED: list[int] = []  # the turn of each generation a ScriptedChat made: its invoices


class ScriptedChat(BaseChatModel):
    """A chat model answering ``script`` (``SCRIPT`` by default) by turn; each generation
    is noted in ``ASKED``."""

    script: list[tuple[str, list[tuple[str, dict[str, Any]]]]] | None = None

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        turn = sum(isinstance(m, AIMessage) for m in messages)
        ASKED.append(turn)
        text, calls = (self.script or SCRIPT)[turn]
        message = AIMessage(
            content=text,
            tool_calls=[
                {"name": name, "args": args, "id": f"call-{turn}-{n}"}
                for n, (name, args) in enumerate(calls)
            ],
            usage_metadata={"input_tokens": 10 + turn, "output_tokens": 3, "total_tokens": 13},
        )
        return ChatResult(generations=[ChatGeneration(message=message)])


def build(
    model: BaseChatModel, tools: list[BaseTool], *, system: str = "You refund orders."
) -> Any:
    """LangGraph's quick-start agent: model node, ToolNode, loop."""
    bound = model.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        messages = [("system", system), *state["messages"]]
        return {"messages": [await bound.ainvoke(messages)]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(tools))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    builder.add_edge("tools", "agent")
    return builder.compile()
