"""Numbered migrations and the SQL of the PostgreSQL journal.

The table ``asiento_schema`` holds one row per applied migration; the highest
is the schema version. Migrations run in one transaction under an advisory
transaction lock, so that processes opening a new database at once apply
each migration exactly once.
"""

from __future__ import annotations

from . import _rules as rules

# "ASNT", as in the SQLite application_id: the advisory lock of the migrations.
MIGRATION_LOCK = 0x41534E54

# Lease times come from the server's clock: the one clock every worker shares.
NOW = "extract(epoch FROM statement_timestamp())::float8"

# Run ids compare byte by byte, as on SQLite, whatever the database's collation.
C = ' COLLATE "C"'

# How full an insert leaves a page of ``runs``: room for in-place (HOT) updates.
FILLFACTOR = 90

CREATE_VERSIONS = """
CREATE TABLE IF NOT EXISTS asiento_schema (
    version    integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: the journal, and the run index with leases and the paid-call ledger.
    (
        """
        CREATE TABLE journal (
            seq        bigint GENERATED ALWAYS AS IDENTITY,
            run_id     text NOT NULL,
            step_id    text NOT NULL,
            phase      text NOT NULL,
            decision   text,
            payload    text NOT NULL,
            created_at double precision NOT NULL,
            PRIMARY KEY (run_id, step_id, phase)
        )
        """,
        """
        CREATE TABLE runs (
            run_id              text PRIMARY KEY,
            status              text NOT NULL,
            events              bigint NOT NULL,
            created_at          double precision NOT NULL,
            updated_at          double precision NOT NULL,
            lease_owner         text,
            lease_host          text,
            lease_pid           bigint,
            lease_started       text,
            lease_expires       double precision,
            lease_ttl           double precision,
            fence               bigint NOT NULL DEFAULT 0,
            model_calls         bigint NOT NULL DEFAULT 0,
            input_tokens        bigint NOT NULL DEFAULT 0,
            output_tokens       bigint NOT NULL DEFAULT 0,
            replayed_calls      bigint NOT NULL DEFAULT 0,
            saved_input_tokens  bigint NOT NULL DEFAULT 0,
            saved_output_tokens bigint NOT NULL DEFAULT 0,
            task                text,
            agent               text,
            attempts            bigint NOT NULL DEFAULT 0,
            reason              text,
            cost                double precision NOT NULL DEFAULT 0,
            saved_cost          double precision NOT NULL DEFAULT 0
        )
        """,
        "CREATE INDEX runs_by_status ON runs (status)",
        # What claim() scanned until migration 5: submitted runs that may need work, oldest
        # update first.
        """
        CREATE INDEX runs_claimable ON runs (updated_at, run_id COLLATE "C")
        WHERE status = 'running' AND task IS NOT NULL
        """,
    ),
    # 2: the tool steps of each run (one intent record each), counted from the journal.
    (
        "ALTER TABLE runs ADD COLUMN tool_steps bigint NOT NULL DEFAULT 0",
        """
        UPDATE runs SET tool_steps = counted.intents
        FROM (SELECT run_id, count(*) AS intents FROM journal
              WHERE phase = 'intent' GROUP BY run_id) AS counted
        WHERE runs.run_id = counted.run_id
        """,
    ),
    # 3: prompt-cache tokens of each run's paid calls (read from, written to a cache);
    # the model results already recorded are summed by ``postgres._backfill_cache_tokens``,
    # in Python: ``payload::jsonb`` refuses the \u0000 and lone surrogate escapes asiento
    # writes, and one such record anywhere made the upgrade fail at every open.
    (
        "ALTER TABLE runs ADD COLUMN cached_input_tokens bigint NOT NULL DEFAULT 0",
        "ALTER TABLE runs ADD COLUMN cache_write_tokens bigint NOT NULL DEFAULT 0",
    ),
    # 4: when each record was written, on the server's clock: what judges a key's age.
    # Added without a default, then given one: a default in ADD COLUMN would stamp
    # every existing record with the migration's time and make old submissions look
    # fresh. Records written before stay NULL and are judged by their created_at.
    (
        "ALTER TABLE journal ADD COLUMN written_at double precision",
        f"ALTER TABLE journal ALTER COLUMN written_at SET DEFAULT {NOW}",
    ),
    # 5: claims order by ``queued_at``, the time a run last joined the queue, which no
    # plain append changes: ``runs_claimable`` indexed ``updated_at``, which every append
    # set, so almost no append could update the run's row in place (HOT). Existing runs
    # keep their place (queued at their last update, the order claims had). A fill
    # factor of 90 leaves a tenth of each page for the updated copies of its rows
    # (docs/performance.md has the figures); it applies to pages written from now on.
    (
        "ALTER TABLE runs ADD COLUMN queued_at double precision",
        "UPDATE runs SET queued_at = updated_at",
        "ALTER TABLE runs ALTER COLUMN queued_at SET NOT NULL",
        f"ALTER TABLE runs ALTER COLUMN queued_at SET DEFAULT {NOW}",
        "DROP INDEX runs_claimable",
        f"""
        CREATE INDEX runs_claimable ON runs ({rules.queue_order(C)})
        WHERE status = 'running' AND task IS NOT NULL
        """,
        f"ALTER TABLE runs SET (fillfactor = {FILLFACTOR})",
    ),
    # 6: each run's budget, as its journal last recorded it (NULL: unset, or not recorded);
    # filled in from the records by ``postgres._backfill_budgets`` (``_backfill``).
    (
        "ALTER TABLE runs ADD COLUMN budget_cost double precision",
        "ALTER TABLE runs ADD COLUMN budget_tokens bigint",
        "ALTER TABLE runs ADD COLUMN budget_model_calls bigint",
    ),
    # 7: a lapsed claim counts against a run only if a tool of its was in flight
    # (``_rules.charge``): the lapses not counted, in a row, and the records the run had
    # when it was last claimed (whether it wrote any before its lease lapsed).
    (
        "ALTER TABLE runs ADD COLUMN lapses bigint NOT NULL DEFAULT 0",
        "ALTER TABLE runs ADD COLUMN claim_events bigint NOT NULL DEFAULT 0",
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)

SELECT_EVENTS = "SELECT step_id, phase, decision, payload, created_at FROM journal"

INSERT_EVENTS = """
INSERT INTO journal (run_id, step_id, phase, decision, payload, created_at)
SELECT r, s, p, d, j, c
FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::float8[])
    WITH ORDINALITY AS batch (r, s, p, d, j, c, n)
ORDER BY n
ON CONFLICT DO NOTHING
RETURNING step_id, phase
"""


def _param(name: str) -> str:
    return f"%({name})s"


UPSERT_RUN = f"""
INSERT INTO runs (run_id, status, events, created_at, updated_at,
                  model_calls, input_tokens, output_tokens, cost, tool_steps,
                  cached_input_tokens, cache_write_tokens,
                  budget_cost, budget_tokens, budget_model_calls)
VALUES (%(run_id)s, coalesce(%(status)s, 'running'), %(added)s, {NOW}, {NOW},
        %(calls)s, %(inp)s, %(out)s, %(cost)s, %(tools)s, %(cread)s, %(cwrite)s,
        %(b_budget_cost)s, %(b_budget_tokens)s, %(b_budget_model_calls)s)
ON CONFLICT (run_id) DO UPDATE SET
    {rules.budget_write(_param, row="runs.")},
    {rules.status_write("%(status)s", NOW, row="runs.")},
    events = runs.events + excluded.events,
    updated_at = excluded.updated_at,
    model_calls = runs.model_calls + excluded.model_calls,
    tool_steps = runs.tool_steps + excluded.tool_steps,
    input_tokens = runs.input_tokens + excluded.input_tokens,
    output_tokens = runs.output_tokens + excluded.output_tokens,
    cached_input_tokens = runs.cached_input_tokens + excluded.cached_input_tokens,
    cache_write_tokens = runs.cache_write_tokens + excluded.cache_write_tokens,
    cost = runs.cost + excluded.cost
WHERE runs.{rules.STILL_OPEN}
RETURNING 1
"""

# What a leased append does to its lease: extends it, or (the closing append) gives it up
# with what the pass saved, as ``RELEASE`` would (a closed run is not requeued).
_EXTENDED = f"lease_expires = {NOW} + lease_ttl"
_GIVEN_UP = """lease_owner = NULL, lease_expires = NULL,
    replayed_calls = replayed_calls + %(saved_calls)s,
    saved_input_tokens = saved_input_tokens + %(saved_inp)s,
    saved_output_tokens = saved_output_tokens + %(saved_out)s,
    saved_cost = saved_cost + %(saved_cost)s"""


def _append_leased(lease: str) -> str:
    """The loop's append: the lease is checked, and ``lease`` done, by the run's own update."""
    return f"""
UPDATE runs SET
    {rules.status_write("%(status)s", NOW)},
    events = events + %(added)s,
    updated_at = {NOW},
    model_calls = model_calls + %(calls)s,
    tool_steps = tool_steps + %(tools)s,
    input_tokens = input_tokens + %(inp)s,
    output_tokens = output_tokens + %(out)s,
    cached_input_tokens = cached_input_tokens + %(cread)s,
    cache_write_tokens = cache_write_tokens + %(cwrite)s,
    cost = cost + %(cost)s,
    {rules.budget_write(_param)},
    {lease}
WHERE run_id = %(run_id)s AND fence = %(token)s AND lease_owner = %(owner)s
  AND lease_expires >= {NOW}
RETURNING 1
"""


APPEND_LEASED = _append_leased(_EXTENDED)
APPEND_RELEASED = _append_leased(_GIVEN_UP)


def _append_events(append: str) -> str:
    """A leased append as one statement, so one round trip and one commit (autocommit):
    the lease checked (and extended or given up), the counters added, the records
    inserted only if the lease held. A record already there aborts the whole statement
    (a unique violation): nothing of the append is written, as when the multi-statement
    transaction is rolled back. The records travel as one JSON text: six arrays cost the
    client more to send than the step."""
    return f"""
WITH lease AS ({append.strip()}),
written AS (
    INSERT INTO journal (run_id, step_id, phase, decision, payload, created_at)
    SELECT row ->> 0, row ->> 1, row ->> 2, row ->> 3, row ->> 4, (row ->> 5)::float8
    FROM json_array_elements(%(rows)s::json) WITH ORDINALITY AS batch (row, n)
    WHERE EXISTS (SELECT 1 FROM lease)
    ORDER BY n
    RETURNING 1
)
SELECT (SELECT count(*) FROM lease), (SELECT count(*) FROM written)
"""


APPEND_LEASED_EVENTS = _append_events(APPEND_LEASED)
APPEND_RELEASED_EVENTS = _append_events(APPEND_RELEASED)

# A renewal as one statement: the new time-to-live, from the server's clock, if the lease holds.
RENEW = f"""
UPDATE runs SET lease_ttl = %(ttl)s, lease_expires = {NOW} + %(ttl)s
WHERE run_id = %(run_id)s AND fence = %(token)s AND lease_owner = %(owner)s
  AND lease_expires >= {NOW}
RETURNING lease_expires
"""

CHECK_LEASE = f"""
UPDATE runs SET lease_expires = {NOW} + lease_ttl
WHERE run_id = %(run_id)s AND fence = %(token)s AND lease_owner = %(owner)s
  AND lease_expires >= {NOW}
RETURNING lease_expires
"""

CREATE_RUN = f"""
INSERT INTO runs (run_id, status, events, created_at, updated_at)
VALUES (%s, 'running', 0, {NOW}, {NOW})
ON CONFLICT (run_id) DO NOTHING
"""

LOCK_RUN = f"""
SELECT lease_owner, lease_host, lease_pid, lease_started, lease_expires, fence, {NOW}
FROM runs WHERE run_id = %s FOR UPDATE
"""

TAKE_LEASE = """
UPDATE runs SET lease_owner = %s, lease_host = %s, lease_pid = %s, lease_started = %s,
    lease_expires = %s, lease_ttl = %s, fence = %s
WHERE run_id = %s
"""


RELEASE = f"""
UPDATE runs SET lease_owner = NULL, lease_expires = NULL, {rules.requeue_released(NOW)},
    replayed_calls = replayed_calls + %s, saved_input_tokens = saved_input_tokens + %s,
    saved_output_tokens = saved_output_tokens + %s, saved_cost = saved_cost + %s,
    attempts = CASE WHEN %s THEN greatest(attempts - 1, 0) ELSE attempts END
WHERE run_id = %s AND fence = %s AND lease_owner = %s
"""

# Every status write but an append's (set_status, parking): ``postgres.set_status``
# refuses to change a closed run before it gets here.
SET_STATUS = f"""
UPDATE runs SET {rules.status_write("%(status)s", NOW)}, updated_at = {NOW},
    reason = coalesce(%(reason)s, reason)
WHERE run_id = %(run_id)s
"""

# The run's row, locked: a person's decision on the run waits for this transaction, or
# this transaction's next statement sees that decision.
LOCK_STATUS = "SELECT status FROM runs WHERE run_id = %s FOR UPDATE"

HOLDS = "SELECT 1 FROM journal WHERE run_id = %s AND step_id = %s AND phase = %s"

SUBMIT = f"""
INSERT INTO runs (run_id, status, events, created_at, updated_at, task, agent)
VALUES (%s, 'running', 0, {NOW}, {NOW}, %s, %s)
ON CONFLICT (run_id) DO NOTHING
RETURNING run_id
"""

# ``_rules.in_flight`` of run ``{run}``: the first tool step (``.t`` in its id, as
# ``step_ids.is_tool``) whose last record over all its attempts is ``submitted``.
IN_FLIGHT = """
(SELECT last.step_id FROM (
    SELECT DISTINCT ON (split_part(j.step_id, '/', 1)) j.step_id, j.phase, j.seq
    FROM journal j WHERE j.run_id = {run} AND j.step_id LIKE '%%.t%%'
    ORDER BY split_part(j.step_id, '/', 1), j.seq DESC
) AS last WHERE last.phase = 'submitted' ORDER BY last.seq LIMIT 1)
"""

# Up to ``limit`` claimable runs, oldest first, in one statement: each judged by
# ``_rules.charge`` (a lapsed claim counts only if a tool was in flight, ``judged``);
# those over their limits parked (the reason recorded), the others leased and counted.
# SKIP LOCKED: many workers claim different runs without waiting for each other.
_PARKS = rules.parks_sql(
    "%(max_attempts)s", attempts="c.attempts", lapses="c.lapses", max_lapses="%(max_lapses)s"
)
_LAST = (
    f"CASE WHEN c.in_flight IS NULL THEN runs.reason ELSE {rules.died_in_sql('c.in_flight')} END"
)
CLAIM_MANY = f"""
WITH picked AS (
    SELECT run_id, queued_at AS was_queued, lease_owner IS NOT NULL AS lapsed,
        events > claim_events AS progressed, attempts, lapses
    FROM runs
    WHERE {rules.claimable(NOW)}
    ORDER BY {rules.queue_order(C)} LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), judged AS (
    SELECT picked.*, CASE WHEN lapsed THEN {IN_FLIGHT.format(run="picked.run_id")} END
        AS in_flight
    FROM picked
), c AS (
    SELECT run_id, was_queued, in_flight,
        CASE WHEN lapsed AND in_flight IS NULL THEN greatest(attempts - 1, 0) ELSE attempts
        END AS attempts,
        CASE WHEN NOT lapsed THEN lapses WHEN in_flight IS NOT NULL THEN 0
            WHEN progressed THEN 1 ELSE lapses + 1 END AS lapses
    FROM judged
), parked AS (
    UPDATE runs SET {rules.status_write("'parked'", NOW, attempts="c.attempts", lapses="c.lapses")},
        updated_at = {NOW},
        reason = {
    rules.parked_reason_sql(
        attempts="c.attempts", last=_LAST, lapses="c.lapses", max_lapses="%(max_lapses)s"
    )
}
    FROM c WHERE runs.run_id = c.run_id AND {_PARKS}
    RETURNING runs.run_id, c.lapses
), taken AS (
    UPDATE runs SET lease_owner = %(owner)s, lease_host = %(host)s, lease_pid = %(pid)s,
        lease_started = %(started)s, lease_expires = {NOW} + %(ttl)s, lease_ttl = %(ttl)s,
        fence = fence + 1, attempts = c.attempts + 1, lapses = c.lapses,
        claim_events = events, reason = {_LAST}, queued_at = {NOW}
    FROM c WHERE runs.run_id = c.run_id AND NOT {_PARKS}
    RETURNING runs.run_id, task, agent, runs.attempts, fence, lease_expires, c.was_queued,
        c.in_flight
)
SELECT p.parked, p.lapsed, t.run_id, t.task, t.agent, t.attempts, t.fence, t.lease_expires,
    t.in_flight
FROM (
    SELECT count(*) AS parked,
        count(*) FILTER (WHERE 0 < %(max_lapses)s AND %(max_lapses)s <= lapses) AS lapsed
    FROM parked
) AS p LEFT JOIN taken AS t ON true
ORDER BY t.was_queued, t.run_id COLLATE "C"
"""

# Every run this holder holds a live lease on (the read-back of a cut-off claim_many).
HELD_ALL = f"""
SELECT run_id, task, agent, attempts, fence, {NOW} FROM runs
WHERE lease_owner = %s AND lease_expires >= {NOW} AND status = 'running' AND task IS NOT NULL
ORDER BY {rules.queue_order(C)}
FOR UPDATE
"""

# The channel that wakes waiting workers: a run may have become claimable.
WORK_CHANNEL = "asiento_work"
NOTIFY_WORK = f"NOTIFY {WORK_CHANNEL}"

# A release as one statement. Only a run given back still running may be claimed again,
# so only then are the workers woken (when it commits): a closed or waiting run's release
# wakes no one, and takes no part in the commit-time lock every NOTIFY queues for.
RELEASE_NOTIFY = f"""
WITH released AS ({RELEASE.strip()} RETURNING status)
SELECT pg_notify('{WORK_CHANNEL}', '') FROM released WHERE status = 'running'
"""
LISTEN_WORK = f"LISTEN {WORK_CHANNEL}"

EXTEND_LEASE = "UPDATE runs SET lease_expires = %s, lease_ttl = %s WHERE run_id = %s AND fence = %s"

SELECT_RUNS = """
SELECT run_id, status, events, created_at, updated_at, lease_owner, lease_expires, fence,
    model_calls, input_tokens, output_tokens, replayed_calls, saved_input_tokens,
    saved_output_tokens, task, agent, attempts, reason, cost, saved_cost, tool_steps,
    cached_input_tokens, cache_write_tokens, budget_cost, budget_tokens, budget_model_calls,
    lease_host, lease_pid, lapses
FROM runs
"""

ORDER_RUNS = ' ORDER BY created_at, run_id COLLATE "C"'

# Seconds since a record was written, on the server's clock; a record older than
# migration 4 has no written_at, and its writer's created_at is judged instead.
AGE = f"""
SELECT {NOW} - coalesce(written_at, created_at) FROM journal
WHERE run_id = %s AND step_id = %s AND phase = %s
"""
