"""The value a key names: drafts for extraction, where the output writes as JSON the facts that the
prompt states as `key: value` lines.

When the output's text ends in a JSON key and the start of its value (`"home": "` or `"age": `),
the prompt's latest line `home: ...` (or `Home = ...`) before it names the value: its text to the
line's end is the draft, closed with a quote for a string. Neither token nor text lookup finds it:
`home: verona` in the record and `"home": "verona"` in the output share no run of 4 bytes around
the value, and after the keys and punctuation that the grammar forces, the values are what an
extraction writes. The grammar cuts a draft at the first token it refuses, and verification keeps
only what the model itself writes, so a wrong guess costs its rows, never a token.
"""

from __future__ import annotations

import re
from functools import lru_cache

# A JSON key and the opening of its value, at the end of the text: `"home": "` or `"age": `.
_OPENED = re.compile(rb'"([A-Za-z_][A-Za-z0-9_ .-]{0,63})"[ \t]*:[ \t]*("?)\Z')
_TAIL = 80  # bytes of the text's end searched for an opened value


@lru_cache(maxsize=256)
def _stated(key: bytes) -> re.Pattern[bytes]:
    """`key: value` or `key = value` on a line (any case; not the end of a longer word, nor a
    quoted JSON key): the value, to the line's end."""
    return re.compile(rb"(?i)(?<![A-Za-z0-9_\"])" + re.escape(key) + rb"[ \t]*[:=][ \t]*([^\r\n]+)")


def named_value(text: bytes | bytearray) -> str | None:
    """What the text states for the JSON key whose value its end opens, closed with a quote where
    the value is a string; None when the end opens no value or no line states the key before it."""
    if not text.endswith((b'"', b" ", b":")):
        return None
    tail_start = max(len(text) - _TAIL, 0)
    opened = _OPENED.search(text, tail_start)
    if opened is None:
        return None
    key, quoted = opened.group(1), opened.group(2)
    statements = list(_stated(key).finditer(text, 0, opened.start()))
    if not statements:
        return None
    found = statements[-1]  # the latest before the key
    value = found.group(1).strip().rstrip(b",;")
    if quoted:
        if len(value) >= 2 and value[:1] == value[-1:] and value[:1] in (b'"', b"'"):
            value = value[1:-1]
        value += b'"'
    return value.decode("utf-8", errors="ignore") or None
