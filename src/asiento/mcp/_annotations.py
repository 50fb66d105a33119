"""MCP tool annotations as asiento's treatment of a tool: the one mapping, by the spec's defaults.

| annotation (trusted server)                      | treated as                          |
|--------------------------------------------------|-------------------------------------|
| ``readOnlyHint: true``                           | idempotent, not destructive         |
| ``idempotentHint: true`` (not read-only)         | idempotent                          |
| neither                                          | non-idempotent                      |
| ``destructiveHint`` true or absent (not r/o)     | destructive: the ready policy asks  |
| any annotation of an untrusted server            | non-idempotent and destructive      |

The spec's defaults: ``readOnlyHint`` false, ``destructiveHint`` true and
``idempotentHint`` false (both meaningful only when not read-only),
``openWorldHint`` true (not used: every MCP tool is a call to elsewhere). The spec
says annotations are untrusted unless the server is: a server is untrusted unless
the user marks it ``trusted=True``, and then every one of its tools is treated as
non-idempotent and destructive. A user's explicit ``Treatment`` for a tool
replaces what the table says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..effects.base import key_margin_of


@dataclass(frozen=True, slots=True, kw_only=True)
class Treatment:
    """How asiento treats one MCP tool.

    ``idempotent``: a crash inside it re-runs it on resume (else write-ahead intent and
    ``UncertainEffect`` on an unknown outcome). ``destructive``: the ready policy
    ``require_approval_for_destructive`` asks a person first. ``honours_keys``: its
    server deduplicates by the key in the call's ``_meta``, for ``key_ttl`` seconds
    (None: forever), so a submitted call is reconciled by calling again with the same
    key while the key is younger than ``key_ttl`` minus ``key_margin``.
    """

    idempotent: bool = False
    destructive: bool = True
    honours_keys: bool = False
    key_ttl: float | None = None
    key_margin: float | None = None

    def __post_init__(self) -> None:
        key_margin_of(self.key_ttl, self.key_margin, who="Treatment")

    def to_json(self) -> dict[str, Any]:
        """What of it a run's fingerprint holds: another treatment is another run."""
        return {
            "idempotent": self.idempotent,
            "destructive": self.destructive,
            "honours_keys": self.honours_keys,
            "key_ttl": self.key_ttl,
            "key_margin": self.key_margin,
        }


UNTRUSTED = Treatment()


def treatment(annotations: Mapping[str, Any] | None, *, trusted: bool) -> Treatment:
    """The treatment the table above gives a tool with these annotations (wire names)."""
    if not trusted:
        return UNTRUSTED
    hints = annotations or {}
    if hints.get("readOnlyHint") is True:
        return Treatment(idempotent=True, destructive=False)
    return Treatment(
        idempotent=hints.get("idempotentHint") is True,
        destructive=hints.get("destructiveHint") is not False,
    )
