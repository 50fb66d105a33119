"""asiento: kill an LLM agent at any instant and resume it without repeating what happened."""

from ._canonical import idem_key, model_key
from .agent import Agent
from .budget import Budget
from .context import StepContext, current_step
from .decisions import abandon, approve, deny, raise_budget, resolve, unpark
from .errors import (
    ApprovalError,
    ApprovalMismatch,
    ApprovalRefused,
    AsientoError,
    DecisionOnClosedRun,
    DuplicateRecord,
    IsolatedToolDied,
    JournalBusy,
    JournalCorrupt,
    JournalError,
    JournalFull,
    JournalReadOnly,
    JournalTooNew,
    LeaseLost,
    MaxTurnsExceeded,
    McpCallLost,
    McpServerUnavailable,
    MigrationFailed,
    NotAJournal,
    RecordTooLarge,
    ReplayDivergence,
    RunAbandoned,
    RunClosed,
    RunError,
    RunLocked,
    ToolAnswerLost,
    ToolUnavailable,
    UncertainEffect,
    UsageError,
)
from .events import (
    ApprovalStep,
    BudgetStep,
    Claim,
    Decision,
    FinalStep,
    Lease,
    ModelStep,
    Phase,
    RunInfo,
    RunStatus,
    Savings,
    Step,
    StepEvent,
    ToolStep,
)
from .gateways._errors import RateLimited
from .gateways.quota import Quota
from .gateways.rate_limit import RateLimitPolicy
from .journal import Checkpointer, MemoryCheckpointer, SqliteCheckpointer
from .journal.url import open_store
from .lease import Holder
from .ledger import Price
from .model import Gateway, Message, ModelRequest, ModelResponse, ToolCall, ToolSchema, Usage
from .policy import Policy, allow_all, require_approval_for, require_approval_for_destructive
from .session import RunStats, Session
from .shutdown import ShutdownRequested
from .streaming import (
    Delta,
    StreamEvent,
    StreamingGateway,
    StreamPart,
    StreamRestart,
    TextPart,
    ToolCallPart,
)
from .telemetry.tracing import Telemetry
from .tools import Tool, tool
from .worker import App, Worker, submit

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``PostgresCheckpointer`` is imported on first use: psycopg is an optional extra."""
    if name == "PostgresCheckpointer":
        from .journal.postgres import PostgresCheckpointer

        return PostgresCheckpointer
    raise AttributeError(f"module 'asiento' has no attribute {name!r}")


__all__ = [
    "Agent",
    "App",
    "ApprovalError",
    "ApprovalMismatch",
    "ApprovalRefused",
    "ApprovalStep",
    "AsientoError",
    "Budget",
    "BudgetStep",
    "Checkpointer",
    "Claim",
    "Decision",
    "DecisionOnClosedRun",
    "Delta",
    "DuplicateRecord",
    "FinalStep",
    "Gateway",
    "Holder",
    "IsolatedToolDied",
    "JournalBusy",
    "JournalCorrupt",
    "JournalError",
    "JournalFull",
    "JournalReadOnly",
    "JournalTooNew",
    "Lease",
    "LeaseLost",
    "MaxTurnsExceeded",
    "McpCallLost",
    "McpServerUnavailable",
    "MemoryCheckpointer",
    "Message",
    "MigrationFailed",
    "ModelRequest",
    "ModelResponse",
    "ModelStep",
    "NotAJournal",
    "Phase",
    "Policy",
    "PostgresCheckpointer",
    "Price",
    "Quota",
    "RateLimitPolicy",
    "RateLimited",
    "RecordTooLarge",
    "ReplayDivergence",
    "RunAbandoned",
    "RunClosed",
    "RunError",
    "RunInfo",
    "RunLocked",
    "RunStats",
    "RunStatus",
    "Savings",
    "Session",
    "ShutdownRequested",
    "SqliteCheckpointer",
    "Step",
    "StepContext",
    "StepEvent",
    "StreamEvent",
    "StreamPart",
    "StreamRestart",
    "StreamingGateway",
    "Telemetry",
    "TextPart",
    "Tool",
    "ToolAnswerLost",
    "ToolCall",
    "ToolCallPart",
    "ToolSchema",
    "ToolStep",
    "ToolUnavailable",
    "UncertainEffect",
    "Usage",
    "UsageError",
    "Worker",
    "__version__",
    "abandon",
    "allow_all",
    "approve",
    "current_step",
    "deny",
    "idem_key",
    "model_key",
    "open_store",
    "raise_budget",
    "require_approval_for",
    "require_approval_for_destructive",
    "resolve",
    "submit",
    "tool",
    "unpark",
]
