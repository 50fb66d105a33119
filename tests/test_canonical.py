"""Canonical JSON: the text every fingerprint and idempotency key is a hash of."""

from __future__ import annotations

import json
from typing import Any

import pytest

from asiento._canonical import canonical_json, compact_encoder, fingerprint, unstable_part

VALUES: list[Any] = [
    {"b": [1, 2.5, None, True, False], "a": {"y": "", "x": -0.0}},
    {"text": 'ünïcødé \u2028 \U0001f600 "quoted" \\ \n\t', "n": 10**30, "f": 1e-300},
    [],
    {},
    "plain",
    3,
    {"nested": [{"z": 1, "a": [{"m": None}]}]},
]


@pytest.mark.parametrize("value", VALUES)
def test_canonical_json_is_json_dumps_sorted_and_compact(value: Any) -> None:
    """Byte for byte what ``json.dumps`` writes: journals written before stay verifiable."""
    expected = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    assert canonical_json(value) == expected
    compact = json.dumps(value, separators=(",", ":"), allow_nan=False)
    assert compact_encoder(sort_keys=False)(value) == compact


def test_a_fingerprint_is_pinned_to_the_text_every_version_hashed() -> None:
    """Sorted keys, no spaces, non-ASCII escaped: the text, and so the hash, never change."""
    value = {"c": "é", "b": [True, None], "a": 1}
    assert canonical_json(value) == '{"a":1,"b":[true,null],"c":"\\u00e9"}'
    assert fingerprint(value) == "16e60ecdacfde4aac8c9687bae1a797cac7f5788ec289a2d3538246347fe0d5c"


@pytest.mark.parametrize(
    ("value", "error"),
    [(float("nan"), ValueError), ({"s": {1, 2}}, TypeError), ({"o": object()}, TypeError)],
)
def test_what_json_cannot_hold_is_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        canonical_json(value)


def test_a_reference_cycle_is_refused() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises((ValueError, RecursionError)):
        canonical_json(cycle)


def test_without_cpythons_c_encoder_the_public_one_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another Python (no ``c_make_encoder``) gets the same text from ``JSONEncoder``."""
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    encode = compact_encoder(sort_keys=True)
    assert encode == json.JSONEncoder.encode.__get__(encode.__self__)  # type: ignore[attr-defined]
    assert encode(VALUES[0]) == canonical_json(VALUES[0])


def test_a_c_encoder_that_writes_other_text_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe at import refuses a private encoder whose output differs from json.dumps."""

    def make(*args: Any) -> Any:
        return lambda obj, level: iter(["something else"])

    monkeypatch.setattr(json.encoder, "c_make_encoder", make)
    encode = compact_encoder(sort_keys=True)
    assert encode(VALUES[0]) == json.dumps(VALUES[0], sort_keys=True, separators=(",", ":"))


def test_unstable_part_names_sets_and_cycles_but_not_shared_values() -> None:
    """A set and a value that contains itself are named by their path; a value reached
    twice without a cycle (shared, not contained in itself) is fine."""
    shared = {"x": [1, 2]}
    assert unstable_part({"a": shared, "b": [shared, (shared,)]}) is None
    assert unstable_part({"a": [1, frozenset()]}, "r") == (
        "r['a'][1] is a set, which has no stable order: return a sorted list"
    )
    loop: dict[str, Any] = {"a": [{}]}
    loop["a"][0]["up"] = loop["a"]
    assert unstable_part(loop, "r") == "r['a'][0]['up'] is r['a'] itself: a reference cycle"
