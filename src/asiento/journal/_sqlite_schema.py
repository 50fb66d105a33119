"""Numbered migrations of the SQLite journal; ``PRAGMA user_version`` holds the number."""

from __future__ import annotations

# "ASNT" as a 32-bit integer: marks the file as an asiento journal.
APPLICATION_ID = 0x41534E54

MIGRATIONS: tuple[str, ...] = (
    # 1: the journal, and the run index with leases and the paid-call ledger.
    """
    CREATE TABLE journal (
        run_id     TEXT NOT NULL,
        step_id    TEXT NOT NULL,
        phase      TEXT NOT NULL,
        decision   TEXT,
        payload    TEXT NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (run_id, step_id, phase)
    );
    CREATE TABLE runs (
        run_id              TEXT PRIMARY KEY,
        status              TEXT NOT NULL,
        events              INTEGER NOT NULL,
        created_at          REAL NOT NULL,
        updated_at          REAL NOT NULL,
        lease_owner         TEXT,
        lease_host          TEXT,
        lease_pid           INTEGER,
        lease_started       TEXT,
        lease_expires       REAL,
        lease_ttl           REAL,
        fence               INTEGER NOT NULL DEFAULT 0,
        model_calls         INTEGER NOT NULL DEFAULT 0,
        input_tokens        INTEGER NOT NULL DEFAULT 0,
        output_tokens       INTEGER NOT NULL DEFAULT 0,
        replayed_calls      INTEGER NOT NULL DEFAULT 0,
        saved_input_tokens  INTEGER NOT NULL DEFAULT 0,
        saved_output_tokens INTEGER NOT NULL DEFAULT 0,
        task                TEXT,
        agent               TEXT,
        attempts            INTEGER NOT NULL DEFAULT 0,
        reason              TEXT,
        cost                REAL NOT NULL DEFAULT 0,
        saved_cost          REAL NOT NULL DEFAULT 0
    );
    CREATE INDEX runs_by_status ON runs (status);
    """,
    # 2: the tool steps of each run (one intent record each), counted from the journal.
    """
    ALTER TABLE runs ADD COLUMN tool_steps INTEGER NOT NULL DEFAULT 0;
    UPDATE runs SET tool_steps = (
        SELECT count(*) FROM journal
        WHERE journal.run_id = runs.run_id AND journal.phase = 'intent'
    );
    """,
    # 3: prompt-cache tokens of each run's paid calls (read from, written to a cache);
    # the existing model results are counted by ``_sqlite_open._backfill_cache_tokens``.
    """
    ALTER TABLE runs ADD COLUMN cached_input_tokens INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN cache_write_tokens INTEGER NOT NULL DEFAULT 0;
    """,
    # 4: claims order by ``queued_at``, the time a run last joined the queue, which no
    # plain append changes (``_rules``), through an index of the claimable runs; existing
    # runs keep their place (queued at their last update, the order claims had).
    """
    ALTER TABLE runs ADD COLUMN queued_at REAL NOT NULL DEFAULT 0;
    UPDATE runs SET queued_at = updated_at;
    CREATE INDEX runs_claimable ON runs (queued_at, run_id)
        WHERE status = 'running' AND task IS NOT NULL;
    """,
    # 5: each run's budget, as its journal last recorded it (NULL: unset, or not recorded);
    # filled in from the records by ``_sqlite_open._backfill_budgets`` (``_backfill``).
    """
    ALTER TABLE runs ADD COLUMN budget_cost REAL;
    ALTER TABLE runs ADD COLUMN budget_tokens INTEGER;
    ALTER TABLE runs ADD COLUMN budget_model_calls INTEGER;
    """,
    # 6: a lapsed claim counts against a run only if a tool of its was in flight
    # (``_rules.charge``): the lapses not counted, in a row, and the records the run had
    # when it was last claimed (whether it wrote any before its lease lapsed).
    """
    ALTER TABLE runs ADD COLUMN lapses INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN claim_events INTEGER NOT NULL DEFAULT 0;
    """,
)

SCHEMA_VERSION = len(MIGRATIONS)
