"""How a Pydantic AI run's model steps are fingerprinted, recorded and read back.

A model step's record is asiento's own ``ModelResult`` (so ``asiento show``, the
ledger and the web page read it like a native step) plus the framework's answer
under ``"pydantic_ai"``, serialised with the framework's own type adapter, which
is what a replay hands back to the agent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai import ModelMessagesTypeAdapter
from pydantic_ai.messages import ModelMessage, TextPart, ToolCallPart
from pydantic_ai.messages import ModelResponse as FrameworkResponse
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.settings import ModelSettings
from pydantic_ai.toolsets import ToolsetTool

from .._canonical import fingerprint
from ..errors import JournalCorrupt
from ..model import ModelResponse, ToolCall, Usage
from ..payloads import ModelResult

FRAMEWORK_KEY = "pydantic_ai"

# Keys whose values differ between two passes of the same run (a prompt's timestamp is
# taken when the pass builds it): they say nothing about what the model is asked.
_VOLATILE = frozenset({"timestamp", "run_id", "conversation_id"})
# Settings that change how a request travels, not what it asks.
_TRANSPORT = frozenset({"extra_headers", "timeout"})

_PARAMETERS: TypeAdapter[ModelRequestParameters] = TypeAdapter(ModelRequestParameters)


def request_fingerprint(
    messages: Sequence[ModelMessage],
    settings: ModelSettings | None,
    parameters: ModelRequestParameters,
) -> str:
    """What the step asks the model, hashed: the conversation, the tools, the settings."""
    asked = {
        "messages": _stable(ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")),
        "settings": {k: v for k, v in dict(settings or {}).items() if k not in _TRANSPORT},
        "parameters": _stable(_PARAMETERS.dump_python(parameters, mode="json")),
    }
    return fingerprint(asked)


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def tool_digests(parameters: ModelRequestParameters) -> dict[str, str]:
    """Each tool the model is offered, by name, and a digest of its definition: what m1
    records, so a resumed run can say which tools changed (``replay.tool_drift``)."""
    dumped = _PARAMETERS.dump_python(parameters, mode="json")
    tools = [*dumped.get("function_tools", []), *dumped.get("output_tools", [])]
    return {str(t.get("name")): fingerprint(_stable(t))[:16] for t in tools}


def model_payload(
    fp: str, response: FrameworkResponse, tools: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The record of a model step: asiento's view of the answer, and the framework's."""
    result = ModelResult(fp=fp, response=_asiento_view(response), tools=tools)
    dumped = ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]
    return result.to_json() | {FRAMEWORK_KEY: dumped}


def recorded_response(payload: Mapping[str, Any], where: str) -> FrameworkResponse:
    """The framework's answer as a model step recorded it."""
    dumped = payload.get(FRAMEWORK_KEY)
    if not isinstance(dumped, Mapping):
        raise JournalCorrupt(
            f"{where}: the model step was not recorded by the Pydantic AI integration "
            "(no framework answer in it); a native run cannot be resumed as a Pydantic AI one"
        )
    message = ModelMessagesTypeAdapter.validate_python([dumped])[0]
    if not isinstance(message, FrameworkResponse):
        raise JournalCorrupt(f"{where}: the recorded framework answer is not a model response")
    return message


def _asiento_view(response: FrameworkResponse) -> ModelResponse:
    """The answer as asiento's own tools show it: text, tool calls, usage, model."""
    text = "".join(p.content for p in response.parts if isinstance(p, TextPart))
    calls = [
        ToolCall(name=p.tool_name, arguments=p.args_as_dict(), id=p.tool_call_id)
        for p in response.parts
        if isinstance(p, ToolCallPart)
    ]
    usage = Usage(
        input_tokens=response.usage.input_tokens,
        output_tokens=response.usage.output_tokens,
        cached_input_tokens=response.usage.cache_read_tokens,
        cache_write_tokens=response.usage.cache_write_tokens,
    )
    return ModelResponse(
        text=text,
        tool_calls=calls,
        usage=usage,
        model=response.model_name or "",
        request_id=response.provider_response_id,
    )


def tool_calls(response: FrameworkResponse) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls the answer asks for (id, arguments), in the order it asks for them."""
    return [
        (p.tool_call_id, p.args_as_dict()) for p in response.parts if isinstance(p, ToolCallPart)
    ]


def is_mcp_tool(tool: ToolsetTool[Any]) -> bool:
    """Whether Pydantic AI listed the tool from an MCP server (its definition says so)."""
    metadata = tool.tool_def.metadata
    return isinstance(metadata, dict) and "annotations" in metadata


def dump_messages(messages: Sequence[ModelMessage]) -> list[Any]:
    return list(ModelMessagesTypeAdapter.dump_python(list(messages), mode="json"))


def load_messages(dumped: Any) -> list[ModelMessage]:
    return list(ModelMessagesTypeAdapter.validate_python(dumped or []))
