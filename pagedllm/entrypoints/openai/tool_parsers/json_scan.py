"""A small incremental scanner for the JSON that tool-calling models write.

Streaming parsers need to know, on a prefix of the model's text, where a JSON value ends (if it has ended yet)
and, inside a call object ``{"name": ..., "arguments": {...}}``, the name and the character span of the arguments
value as written. Arguments are returned *as the model wrote them* (a verbatim, valid JSON substring), so the
fragments a stream sends concatenate exactly to the non-streamed ``arguments``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> Optional[int]:
    """``text[i] == '"'``: the index after the closing quote, or None if the string hasn't closed yet."""
    j = i + 1
    n = len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> Optional[int]:
    """The index after the JSON value starting at ``text[i]`` (no leading whitespace), or None if it is incomplete.

    Only the structure is checked (brackets and strings); ``json.loads`` checks the rest. A scalar at the very end
    of ``text`` counts as incomplete (more digits may follow).
    """
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < n:
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < n else None


@dataclass
class CallScan:
    """What a prefix of ``{"name": "f", "arguments": {...}}`` shows so far (indices into the scanned text)."""

    name: Optional[str] = None  # once the name string has closed
    args_start: Optional[int] = None  # where the arguments value starts (after ``"arguments":`` and whitespace)
    args_end: Optional[int] = None  # after the arguments value, once it is complete
    end: Optional[int] = None  # after the object's closing brace
    malformed: bool = False  # not a call object (a structural error, or no name/arguments once complete)


def scan_call(text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallScan:
    """Scans the call object starting at ``text[i] == '{'``."""
    out = CallScan()
    n = len(text)
    j = skip_ws(text, i + 1)
    while True:
        if j >= n:
            return out
        if text[j] == "}":
            out.end = j + 1
            if out.name is None or out.args_end is None:
                out.malformed = True
            return out
        if text[j] != '"':
            out.malformed = True
            return out
        kend = scan_string(text, j)
        if kend is None:
            return out
        try:
            key = json.loads(text[j:kend])
        except ValueError:
            out.malformed = True
            return out
        j = skip_ws(text, kend)
        if j >= n:
            return out
        if text[j] != ":":
            out.malformed = True
            return out
        j = skip_ws(text, j + 1)
        if j >= n:
            return out
        vstart = j
        if key in args_keys:
            out.args_start = vstart
        vend = scan_value(text, vstart)
        if vend is None:
            return out
        if key == "name":
            try:
                name = json.loads(text[vstart:vend])
            except ValueError:
                name = None
            if not isinstance(name, str):
                out.malformed = True
                return out
            out.name = name
        elif key in args_keys:
            out.args_end = vend
        j = skip_ws(text, vend)
        if j >= n:
            return out
        if text[j] == ",":
            j = skip_ws(text, j + 1)
        elif text[j] != "}":
            out.malformed = True
            return out


def stable_args_end(text: str, start: int) -> int:
    """How far the arguments text from ``start`` may be streamed: everything but trailing whitespace (which may
    turn out to lie outside the value)."""
    end = len(text)
    while end > start and text[end - 1] in _WS:
        end -= 1
    return end


def array_object_starts(text: str, i: int) -> list[int]:
    """Offsets of the objects of a JSON array of objects whose ``[`` is at ``text[i]``: each complete object's
    start, then the start of a last one still open (streaming); stops at the first element that isn't an object."""
    starts = []
    j = skip_ws(text, i + 1)
    while j < len(text) and text[j] == "{":
        starts.append(j)
        end = scan_value(text, j)
        if end is None:
            break
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        else:
            break
    return starts
