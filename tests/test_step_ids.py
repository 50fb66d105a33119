"""The one grammar of step ids: what it builds, and what it reads back."""

from __future__ import annotations

from asiento import step_ids


def test_ids_as_the_journal_holds_them() -> None:
    """m{n}, m{n}.t{k}, m{n}.t{k}/{a} (the first attempt is the step id), final."""
    m2 = step_ids.model(2)
    t3 = step_ids.tool(m2, 3)
    assert (m2, t3, step_ids.attempt(t3, 1), step_ids.attempt(t3, 2)) == (
        "m2",
        "m2.t3",
        "m2.t3",
        "m2.t3/2",
    )
    assert step_ids.FINAL == "final"


def test_reading_ids_back() -> None:
    """base, is_tool, is_retry and is_model tell each kind of id apart."""
    cases = {
        "m12": ("m12", False, False, True),
        "m12.t4": ("m12.t4", True, False, False),
        "m12.t4/3": ("m12.t4", True, True, False),
        "final": ("final", False, False, False),
    }
    for record_id, expected in cases.items():
        found = (
            step_ids.base(record_id),
            step_ids.is_tool(record_id),
            step_ids.is_retry(record_id),
            step_ids.is_model(record_id),
        )
        assert found == expected, record_id
