"""Every error asiento raises, rooted in one class.

    AsientoError
    ├── UsageError              the caller misused the API (bad argument, unknown run or step)
    │   ├── RunClosed           the run is closed: it takes no decision and no new record
    │   ├── ApprovalRefused     a decision that does not apply (not awaited, decided, other
    │   │                       arguments shown); also an ApprovalError
    │   └── DecisionOnClosedRun an approval or denial on a closed run (a RunClosed and an
    │                           ApprovalRefused)
    ├── JournalError            the journal cannot be trusted or written as asked
    │   ├── DuplicateRecord     (run_id, step_id, phase) is already recorded: a rival writer won
    │   ├── NotAJournal         the file is not an asiento journal (or not SQLite at all)
    │   ├── JournalCorrupt      the journal file is damaged; it is never overwritten
    │   ├── JournalBusy         another process held the write lock past the timeout
    │   ├── JournalReadOnly     the journal cannot be written here (read-only file system, rights)
    │   ├── JournalFull         the disk (or the journal's size limit) is full; nothing was written
    │   ├── RecordTooLarge      a record's payload is over the journal's size limit
    │   ├── JournalTooNew       the journal was written by a newer asiento
    │   ├── MigrationFailed     upgrading the journal's schema failed; it was left unchanged
    │   ├── RunLocked           another session holds the run's lease
    │   ├── LeaseLost           this session's lease expired or was taken over: it writes nothing
    │   │   └── RunAbandoned    a person abandoned the run while this session drove it
    │   ├── ApprovalMismatch    the journal's approval is for other arguments than the step
    │   │                       froze: it approves nothing; also an ApprovalError
    │   └── ReplayDivergence    the resumed run would send a different request than recorded
    ├── RunError                the run cannot go on without a person
    │   ├── UncertainEffect     an effect was submitted and nobody knows whether it happened
    │   ├── ApprovalError       an approval does not apply: ApprovalRefused or ApprovalMismatch
    │   ├── MaxTurnsExceeded    the model kept asking for tools past the agent's bound
    │   ├── IdempotencyKeyConflict  the destination saw the key with other parameters (effects)
    │   ├── ToolUnavailable     a tool's destination cannot be reached and nothing was sent:
    │   │   │                   recorded as not happened, the step runs on resume
    │   │   └── McpServerUnavailable  an MCP server cannot be reached or started (mcp)
    │   ├── ToolAnswerLost      a tool's call may have reached its destination and its answer
    │   │   │                   was lost or unreadable (an MCP result that is not MCP, an HTTP
    │   │   │                   effect's failure): the step is settled on resume by the table
    │   │   └── McpCallLost     an MCP server went away with a call in flight: the step is
    │   │                       settled on resume (re-run, same key, or UncertainEffect) (mcp)
    │   ├── ShutdownRequested   a shutdown was asked for: the run stopped between steps (shutdown)
    │   └── ModelCallFailed     the model could not be asked or answered badly (gateways)
    │       ├── ModelRequestRejected  the provider refused the request: the caller's to fix
    │       ├── ModelUnavailable      the provider is down or overloaded: retry later
    │       │   └── RateLimited       the provider's 429s outlasted asiento's retries
    │       └── ModelResponseInvalid  the answer cannot be recorded: the model's fault
    ├── EffectRejected          the destination refused an effect: it certainly did not happen
    │                           (effects; recorded as the step's failed outcome)
    ├── ToolArgumentsError      arguments that do not fit a tool (tools; also a ValueError,
    │                           recorded as the step's failed outcome)
    ├── PrepareFailed           a tool's runner could not prepare a step (tools; recorded as
    │                           the step's failed outcome, nothing runs)
    └── ProxyError              the gateway proxy cannot start or serve (proxy)

    Of ``asiento.testing``: ``CampaignFailed`` (violations found; also an
    AssertionError), ``HarnessError`` (the crash harness itself could not work),
    ``TornLedger`` (a ledger ends in half a line), ``PostgresUnavailable`` (no
    throwaway PostgreSQL could be started; also a RuntimeError).

Messages name the run, the step and what to do about it.
"""

from __future__ import annotations

import shlex


class AsientoError(Exception):
    """Root of every error raised by asiento."""


class UsageError(AsientoError):
    """The API was called in a way it does not support."""


class RunClosed(UsageError):
    """The run is closed (it answered, or a person abandoned it): nothing more is recorded.

    A closed run stays closed: approving, denying or resolving one is refused and
    writes nothing, and no worker claims it again.
    """


class JournalError(AsientoError):
    """The journal cannot be read or written as asked."""


class DuplicateRecord(JournalError):
    """The primary key (run_id, step_id, phase) already holds a record."""

    def __init__(self, run_id: str, step_id: str, phase: str) -> None:
        self.run_id, self.step_id, self.phase = run_id, step_id, phase
        super().__init__(
            f"run {run_id!r} step {step_id!r} already has a {phase!r} record; "
            "another writer recorded it first and nothing was written"
        )


class NotAJournal(JournalError):
    """The file exists but is not an asiento journal."""


class JournalCorrupt(JournalError):
    """The journal's storage reported damage; asiento refuses to guess around it."""


class JournalBusy(JournalError):
    """Another process kept the journal locked longer than the timeout."""


class JournalReadOnly(JournalError):
    """The journal cannot be written where it is: nothing was written.

    A read-only file system or mount, or a file (or its directory, where SQLite keeps
    the ``-wal`` and ``-shm`` files) this process has no right to write. To only read
    such a journal, open it with ``SqliteCheckpointer(path, read_only=True)``.
    """


class JournalFull(JournalError):
    """No room left for the journal: the transaction was rolled back, nothing recorded.

    A full disk, the file size limit (``ulimit -f``) or a disk quota. Free some space
    or raise the limit and resume the run: what was recorded before is intact.
    """


class RecordTooLarge(JournalError):
    """A record's JSON payload is larger than ``MAX_RECORD_BYTES``; nothing was written."""


class JournalTooNew(JournalError):
    """The journal's schema version is newer than this asiento understands."""


class MigrationFailed(JournalError):
    """A schema migration failed; its transaction was rolled back, the journal is unchanged.

    ``migration`` is the number of the migration that failed and ``version`` the
    schema the journal is still at. A busy, damaged, full or read-only journal met
    during a migration raises ``JournalBusy``, ``JournalCorrupt``, ``JournalFull``
    or ``JournalReadOnly`` instead, with the same facts in its message.
    """

    def __init__(self, message: str, *, migration: int, version: int) -> None:
        self.migration, self.version = migration, version
        super().__init__(message)


class RunLocked(JournalError):
    """Another live session holds the run's lease."""


class LeaseLost(JournalError):
    """The session's lease expired or was taken over; its writes are refused."""


class RunAbandoned(LeaseLost):
    """A person abandoned the run while this session drove it.

    Abandoning takes the run's fence, as a takeover does: from then on this
    session writes nothing and starts no effect. ``in_flight`` names the steps
    whose outcome this session had and could no longer record.
    """

    def __init__(self, run_id: str, text: str, in_flight: tuple[str, ...] = ()) -> None:
        self.run_id, self.in_flight = run_id, in_flight
        lost = ""
        if in_flight:
            steps = ", ".join(repr(s) for s in in_flight)
            lost = (
                f" The outcome of {steps}, known to this session, is not in the journal: "
                "the closed run records nothing more."
            )
        super().__init__(
            f"run {run_id!r} was {text} while this session drove it; the session stopped "
            f"and starts no new effect.{lost}"
        )


class ReplayDivergence(JournalError):
    """The resumed run differs from what the journal recorded."""

    def __init__(self, run_id: str, step_id: str, detail: str) -> None:
        self.run_id, self.step_id = run_id, step_id
        super().__init__(
            f"run {run_id!r} diverges from its journal at step {step_id!r}: {detail}. "
            "The task, the instructions or the tools changed since the run was recorded; "
            "resume it with the original agent and task, or start a new run_id"
        )


class RunError(AsientoError):
    """The run stopped and needs a person before it can go on."""


class UncertainEffect(RunError):
    """A non-idempotent effect was submitted and no outcome was recorded.

    Raised instead of guessing: the effect may or may not have happened.
    """

    def __init__(self, run_id: str, step_id: str, tool: str, detail: str = "") -> None:
        self.run_id, self.step_id, self.tool = run_id, step_id, tool
        extra = f" {detail}" if detail else ""
        super().__init__(
            f"run {run_id!r} step {step_id!r}: tool {tool!r} was submitted but no result was "
            f"recorded, and it is not idempotent, so nobody knows whether it happened.{extra} "
            "Check the destination, then record what you found: "
            f"`asiento resolve {shlex.quote(run_id)} {shlex.quote(step_id)} --happened "
            "[--remote-id ID] | --not-happened --by NAME`, or in Python "
            f"asiento.resolve(store, {run_id!r}, {step_id!r}, happened=...)"
        )


class ApprovalError(RunError):
    """An approval or denial does not apply to the step it names (one of the two below)."""


class ApprovalRefused(ApprovalError, UsageError):
    """A person's decision was refused, and nothing was recorded: the caller's to fix.

    The step is not awaiting a decision, was decided already, or the arguments the
    person was shown are not the ones the step froze.
    """


class DecisionOnClosedRun(RunClosed, ApprovalRefused):
    """An approval or denial of a step of a closed run: refused, and nothing recorded."""


class ApprovalMismatch(ApprovalError, JournalError):
    """The journal holds an approval given for other arguments than the step froze.

    It approves nothing: the step waits for a decision on its own arguments.
    """


class IsolatedToolDied(RunError):
    """The process of an ``@tool(isolated=True)`` tool died before it answered.

    Nobody knows how far it got: the step stays submitted, and the next pass settles it
    by the replay table (an idempotent tool runs again, another is uncertain), as after
    a crash of the whole worker; the worker and its other runs go on.
    """


class ToolUnavailable(RunError):
    """A tool's destination cannot be reached, and the call certainly never left.

    Raised by a runner's ``execute``: the loop records that the step did not happen
    (a resolution by asiento), so the run stops with nothing recorded as happened and
    the step runs, once, when the run is resumed with its destination back.
    """


class McpServerUnavailable(ToolUnavailable):
    """An MCP server cannot be started or reached: nothing was sent to it.

    Listing its tools raises it before a run starts; a call raises it when the server
    cannot be reached again before the request is sent. Start the server (or fix its
    command, URL or headers) and resume the run.
    """


class ToolAnswerLost(RunError):
    """A tool's call may have reached its destination, and its answer is lost or unreadable.

    An MCP server that answered with a result no MCP client can read, an HTTP effect
    whose publish failed after the request left: the effect may have happened, so
    nothing is recorded as its outcome. The message names the source and the tool, and
    the library's own exception is the ``__cause__``. The step stays submitted, and the
    resumed run settles it by the replay table: an idempotent tool runs again, a
    key-honouring destination is asked again under the same key, an effect with a
    lookup looks, any other is an ``UncertainEffect`` for a person to resolve.
    """


class McpCallLost(ToolAnswerLost):
    """An MCP server went away (or stopped answering) with a call in flight.

    Nobody knows yet whether the call happened: the step stays submitted, and the
    resumed run settles it by the tool's treatment: a repeat-safe tool runs again, a
    key-honouring one is called again with the same key, any other is an
    ``UncertainEffect`` for a person to resolve.
    """


class MaxTurnsExceeded(RunError):
    """The model asked for tools more times than the agent allows."""
