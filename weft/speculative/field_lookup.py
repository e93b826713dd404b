"""The value a key names: drafts for extraction, where the output writes as JSON the facts that the
prompt states as `key: value` lines.

When the output's text ends in a JSON key and the start of its value (`"home": "` or `"age": `),
the prompt's latest line `home: ...` (or `Home = ...`) before it names the value: its text to the
line's end is the draft (quoted unless it is a JSON number, true, false or null; after a bare
`:` with the space first, as the model writes ` "` or ` ` before its first character), closed as
a member that more follow: `",` after a string (one token in most vocabularies, which a draft
ending in a bare quote would miss), `,` after a number. Where
the object ends instead, the grammar cuts the draft at the comma and the verifying step samples
the end. Neither token nor text lookup finds it:
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
_BARE = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null")  # JSON, unquoted


@lru_cache(maxsize=256)
def _stated(key: bytes) -> re.Pattern[bytes]:
    """`key: value` or `key = value` on a line (any case; not the end of a longer word, nor a
    quoted JSON key): the value, to the line's end."""
    return re.compile(rb"(?i)(?<![A-Za-z0-9_\"])" + re.escape(key) + rb"[ \t]*[:=][ \t]*([^\r\n]+)")


def named_value(text: bytes | bytearray) -> str | None:
    """What the text states for the JSON key whose value its end opens, closed as a member that
    more follow (`",` after a string, `,` after a number); None when the end opens no value or no
    line states the key before it."""
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
    string = len(value) >= 2 and value[:1] == value[-1:] and value[:1] in (b'"', b"'")
    if string:
        value = value[1:-1]
    if not value:
        return None
    if quoted:  # the string is open: its text, closed
        value += b'"'
    elif string or _BARE.fullmatch(value) is None:  # a string, opened here too
        value = b'"' + value + b'"'
    if text.endswith(b":"):  # the separator first, as `json.dumps` writes it
        value = b" " + value
    return (value + b",").decode("utf-8", errors="ignore")


# A `key: value` (or `key = value`) line: what `named_value` can draft from.
_ANY_STATEMENT = re.compile(rb"(?im)^[ \t]*[A-Za-z_][A-Za-z0-9_ .-]{0,63}[ \t]*[:=][ \t]*[^\s]")


def states_fields(text: bytes | bytearray) -> bool:
    """Whether some line of the text states a value as `key: value` or `key = value`."""
    return _ANY_STATEMENT.search(text) is not None
