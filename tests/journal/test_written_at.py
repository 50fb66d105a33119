"""PostgreSQL stamps when each record was written, on its own clock (schema 4).

A key's age is judged on that stamp. Records written before schema 4 have none
(the migration must not stamp them with its own time, which would make old
submissions look fresh): their writer's ``created_at`` is judged against the
server's clock instead.
"""

from __future__ import annotations

import psycopg

from asiento import Phase, StepEvent
from asiento.journal import _postgres_schema as pg_schema
from asiento.journal.postgres import PostgresCheckpointer

HOURS_2 = 7200.0


def postgres_at_schema_3(dsn: str) -> None:
    """The test's schema with migrations 1 to 3, holding records of that version's asiento:
    one submitted two hours ago, one stamped by a writer whose clock was 10 min ahead."""
    with psycopg.connect(dsn) as conn:
        conn.execute(pg_schema.CREATE_VERSIONS)
        for number, statements in enumerate(pg_schema.MIGRATIONS[:3], 1):
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO asiento_schema (version) VALUES (%s)", (number,))
        conn.execute(
            "INSERT INTO journal (run_id, step_id, phase, payload, created_at) VALUES"
            f" ('old', 'm1.t1', 'submitted', '{{}}', {pg_schema.NOW} - %s),"
            f" ('old', 'm2.t1', 'submitted', '{{}}', {pg_schema.NOW} + 600)",
            (HOURS_2,),
        )


def written_at(dsn: str) -> dict[tuple[str, str], float | None]:
    """Each record's server stamp, by (run, step)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT run_id, step_id, written_at FROM journal").fetchall()
    return {(run_id, step_id): stamp for run_id, step_id, stamp in rows}


async def test_records_older_than_schema_4_are_judged_by_their_created_at(pg_dsn: str) -> None:
    """The upgrade leaves old records unstamped: a submission two hours old stays two hours
    old (not as young as the migration), and one from a clock ahead reads negative."""
    postgres_at_schema_3(pg_dsn)
    store = await PostgresCheckpointer.connect(pg_dsn)
    try:
        assert written_at(pg_dsn) == {("old", "m1.t1"): None, ("old", "m2.t1"): None}
        old = await store.age("old", "m1.t1", Phase.SUBMITTED)
        ahead = await store.age("old", "m2.t1", Phase.SUBMITTED)
    finally:
        await store.close()
    assert old is not None
    assert HOURS_2 <= old < HOURS_2 + 1800
    assert ahead is not None
    assert -600 <= ahead < 0


async def test_records_written_after_the_upgrade_are_stamped_by_the_server(pg_dsn: str) -> None:
    """A record from a writer whose clock is two hours behind is as old as the server says."""
    postgres_at_schema_3(pg_dsn)
    store = await PostgresCheckpointer.connect(pg_dsn)
    try:
        with psycopg.connect(pg_dsn) as conn:
            (server_now,) = conn.execute(f"SELECT {pg_schema.NOW}").fetchone() or (0.0,)
        behind = server_now - HOURS_2
        await store.append(
            StepEvent(run_id="new", step_id="m1.t1", phase=Phase.SUBMITTED, created_at=behind)
        )
        age = await store.age("new", "m1.t1", Phase.SUBMITTED)
    finally:
        await store.close()
    stamped = written_at(pg_dsn)
    assert stamped["old", "m1.t1"] is None  # the upgraded run's record, untouched
    assert stamped["new", "m1.t1"] is not None
    assert age is not None
    assert 0.0 <= age < 1800
