"""One pass of a durable Pydantic AI run in its own process, for the crash tests.

    python tests/integrations/pydantic_ai_child.py DB RUN_ID BASE_URL EFFECTS [options]

The agent is a real ``pydantic_ai.Agent`` on ``OpenAIChatModel`` (the official
``openai`` client), or ``AnthropicModel`` (the official ``anthropic`` client) with
``--anthropic``, against ``BASE_URL``. Its ``refund`` tool appends one line to
``EFFECTS`` per run: the effect the tests count across processes. Arm
``ASIENTO_CRASH_AT`` to have the pass kill itself with SIGKILL. With ``--spans FILE``
the run is traced (``telemetry=``): each span one fsynced JSON line of ``FILE`` as it
ends, so what a killed pass exported outlives it. The outcome is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any


async def _pass(args: argparse.Namespace) -> dict[str, Any]:
    from pydantic_ai import Agent, DeferredToolRequests, ModelRetry
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento import ReplayDivergence, SqliteCheckpointer, UncertainEffect, UsageError
    from asiento.effects.base import IdempotencyKeyConflict
    from asiento.errors import McpCallLost, ToolAnswerLost
    from asiento.integrations.pydantic_ai import durable_run

    model: Any
    if args.anthropic:  # the official anthropic client, at the same fake provider
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        base = args.base_url.removesuffix("/v1")
        model = AnthropicModel(
            "claude-test", provider=AnthropicProvider(base_url=base, api_key="sk-test")
        )
    else:
        provider = OpenAIProvider(base_url=args.base_url, api_key="sk-test")
        model = OpenAIChatModel("gpt-test", provider=provider)
    output: Any = [str, DeferredToolRequests] if args.approval else str
    toolsets: list[Any] = []
    if args.mcp:
        from fastmcp.client.transports import StdioTransport
        from pydantic_ai.mcp import MCPToolset

        env = {**os.environ, "MCP_LEDGER": args.effects, "MCP_DEDUP": args.effects + ".keys"}
        server = StdioTransport(command=sys.executable, args=[args.mcp, "stdio"], env=env)
        hook = _hook(Path(args.effects + ".hook"), args.hook_key) if args.hook else None
        mcp: Any = MCPToolset(server, id="notes", process_tool_call=hook)
        toolsets.append(mcp.prefixed(args.prefix) if args.prefix else mcp)
    agent = Agent(model, instructions=args.instructions, output_type=output, toolsets=toolsets)

    @agent.tool_plain(requires_approval=args.approval)
    def refund(order: str) -> str:
        """Refund an order."""
        log = Path(args.effects)
        if args.retry_once and not log.exists():  # the first call asks the model again
            log.write_text("retried\n")
            raise ModelRetry("the refund service is busy; ask again")
        with log.open("a") as f:
            f.write(order + "\n")
        return f"refunded {order}"

    if args.slow_lookup is not None:

        @agent.tool_plain
        async def lookup(order: str) -> str:
            """Look an order up (idempotent, slow): it notes when it starts and ends."""
            with Path(args.effects + ".lookup").open("a") as f:
                f.write(f"start {order}\n")
            await asyncio.sleep(args.slow_lookup)
            with Path(args.effects + ".lookup").open("a") as f:
                f.write(f"done {order}\n")
            return f"{order} is paid"

    store = SqliteCheckpointer(args.db)
    idempotent = ["refund"] if args.idempotent else []
    idempotent += ["lookup"] if args.slow_lookup is not None else []
    try:
        result = await durable_run(
            agent,
            args.prompt,
            run_id=args.run_id,
            store=store,
            idempotent=idempotent,
            trusted_mcp=["notes"] if args.trusted else [],
            honours_keys=None if args.honours is None else {"notes": args.honours},
            telemetry=_telemetry(args.spans),
        )
    except UncertainEffect as exc:
        why = {"why": str(exc)} if args.why else {}
        return {"ended": "uncertain", "step": exc.step_id, **why}
    except ReplayDivergence as exc:
        return {"ended": "divergence", "step": exc.step_id}
    except (IdempotencyKeyConflict, McpCallLost, ToolAnswerLost, UsageError) as exc:
        return {"ended": type(exc).__name__, "why": str(exc)}
    finally:
        await store.close()
        await model.client.close()  # its connections (a test runs a pass in its own process)
    stats = result.stats
    if result.awaiting:
        return {
            "ended": "awaiting",
            "steps": list(result.awaiting),
            "model_calls": stats.model_calls,
        }
    return {
        "ended": "already closed" if result.replayed else "closed",
        "output": result.output,
        "model_calls": stats.model_calls,
        "replayed": stats.model_calls_replayed,
        "tool_calls": stats.tool_calls,
        "tools_replayed": stats.tool_calls_replayed,
    }


def _telemetry(spans: str | None) -> Any:
    """Tracing to ``spans``, one JSON line per span as it ends (None: untraced)."""
    if spans is None:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

    from asiento import Telemetry
    from asiento.testing._files import append_line

    class Lines:
        def export(self, batch: Any) -> SpanExportResult:
            for span in batch:
                append_line(spans, json.loads(span.to_json(indent=None)))
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            return None

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Lines()))  # type: ignore[arg-type]
    return Telemetry(tracer_provider=provider)


def _hook(log: Path, key: str | None) -> Any:
    """The user's own ``process_tool_call``: it logs each call and adds its own ``_meta``
    (with ``key``, an idempotency key of its own: the hook's bug)."""
    meta = {"test/tag": "from-hook"}
    if key is not None:
        meta["asiento/idempotency-key"] = key

    async def hook(ctx: Any, call_tool: Any, name: str, tool_args: dict[str, Any]) -> Any:
        with log.open("a") as f:
            f.write(name + "\n")
        return await call_tool(name, tool_args, metadata=meta)

    return hook


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The pass's command line, parsed (a test drives a pass in its own process with it)."""
    parser = argparse.ArgumentParser()
    for name in ("db", "run_id", "base_url", "effects"):
        parser.add_argument(name)
    parser.add_argument("--instructions", default="Refund what you are asked to.")
    parser.add_argument("--idempotent", action="store_true")
    parser.add_argument("--prompt", default="refund A1")
    parser.add_argument("--approval", action="store_true", help="refund requires approval")
    parser.add_argument("--mcp", help="an MCP server script (stdio) whose tools the agent has")
    parser.add_argument("--trusted", action="store_true", help="trust its annotations")
    parser.add_argument("--honours", type=float, help="its server keeps keys this long (s)")
    parser.add_argument("--hook", action="store_true", help="a process_tool_call hook of ours")
    parser.add_argument("--hook-key", help="the hook sends this idempotency key of its own")
    parser.add_argument("--why", action="store_true", help="say why a run is uncertain")
    parser.add_argument("--prefix", help="the MCP toolset prefixed (a wrapper around it)")
    parser.add_argument("--retry-once", action="store_true", help="refund raises ModelRetry once")
    parser.add_argument("--anthropic", action="store_true", help="AnthropicModel, not OpenAI")
    parser.add_argument("--slow-lookup", type=float, help="an idempotent lookup tool, this slow")
    parser.add_argument("--spans", help="trace the run: its spans to this file, a line each")
    return parser.parse_args(argv)


async def one_pass(args: argparse.Namespace) -> dict[str, Any]:
    """One pass of the run as ``args`` say; its outcome."""
    return await _pass(args)


def main() -> None:
    outcome = asyncio.run(_pass(arguments()))
    sys.stdout.write(json.dumps(outcome) + "\n")


if __name__ == "__main__":
    main()
