"""What a model or a user wrote, made safe to show on a terminal.

A tool name, a run id, an argument or a result may hold control characters: an escape
sequence that clears the screen or writes the clipboard (OSC 52), a carriage return that
overwrites the line, a bidi override that shows ``gnp.exe`` as ``exe.png``. asiento's
commands print such text with those characters spelled out (``\\x1b``, ``\\u202e``)
instead, and their ``--json`` escapes them (valid JSON, the same string once parsed).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

# C0 controls but tab and newline, DEL, C1 controls, and the invisible characters that
# reorder or hide text (bidi embeddings, overrides and isolates, marks, line separators).
_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]"
)
# In JSON text: only the characters json.dumps(ensure_ascii=False) leaves as they are.
_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _spelled(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every unsafe character spelled out (``\\x1b``, ``\\u202e``)."""
    return _UNSAFE.sub(_spelled, text)


def scrubbed(value: Any) -> Any:
    """``value`` (strings, mappings, lists, dataclasses of them) with ``printable`` text."""
    if isinstance(value, Enum):  # a status, a phase: asiento's own words
        return value
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, Mapping):
        return {scrubbed(k): scrubbed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(scrubbed(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: scrubbed(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def json_text(data: Any) -> str:
    """JSON for a terminal or a pipe: readable non-ASCII text, unsafe characters escaped."""
    text = json.dumps(data, ensure_ascii=False, indent=2)
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
