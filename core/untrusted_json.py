"""JSON from outside the platform (a client's body or query parameter, a node's answer): read so that every
refusal is a ValueError with a message that says why.

Python's json raises RecursionError, not ValueError, on deeply nested input ("[" * 3000), and callers catch
ValueError: a 500 (or a check crashed by a node's answer). Here that is TooDeep, and so is nesting deeper than
MAX_DEPTH, which still parses but could exhaust the stack later (repr in an error message, json.dumps in a
JSONField, the database driver). No input of this platform is nested nearly that deep.

JSON's "\\ud800" escape also gives a string no UTF-8 encoder takes (an unpaired UTF-16 surrogate): DRF's CharField
refuses it, but a value read without one (a JSONField, /compat/vast's hand-read bodies and query JSON, an error
message that quotes it) reached the database driver or the renderer as a 500. Refused here (NotUnicode), for every
key and string.

`loads` also refuses what Python's json takes but JSON does not mean a number by: NaN, Infinity and -Infinity, a
float beyond the double's range (1e999 is inf), and an integer past 64 bits (10**400 parses; math.isfinite on it
raises OverflowError, a verification crashed as the platform's failure; jsonb and bigint columns refuse it). A node's
answer (`answer_loads`) also may not hold a NUL character anywhere: no PostgreSQL text column takes one, and a NUL in
a key or an error message the platform quoted into `last_error` or a node event failed the write (the batch's).
"""
import json
import math
from typing import Any

MAX_DEPTH = 64
TOO_DEEP = f"JSON nested deeper than {MAX_DEPTH} levels."
HAS_NUL = "JSON text holds the NUL character (\\u0000), which no text column takes."
INT_LIMIT = 2**63  # bigint's; the JSON numbers of this platform are far below it
NOT_UNICODE = "JSON text holds an unpaired UTF-16 surrogate (an escape such as \\ud800 alone), which is not Unicode."


class Refused(ValueError):
    """JSON that parses but is refused (its message says why)."""


class TooDeep(Refused):
    def __init__(self) -> None:
        super().__init__(TOO_DEEP)


class NotUnicode(Refused):
    def __init__(self, where: str = "") -> None:
        super().__init__(f"{NOT_UNICODE[:-1]}, at `{where[:100]}`." if where else NOT_UNICODE)


class HasNul(Refused):
    def __init__(self, where: str = "") -> None:
        super().__init__(f"{HAS_NUL[:-1]}, at `{where[:100]}`." if where else HAS_NUL)


class NotANumber(Refused):
    """NaN, Infinity, a float past the double's range, an integer past 64 bits."""


def check_json(value: Any, *, refuse_nul: bool = False) -> Any:
    """`value` itself; TooDeep if its lists and objects nest deeper than MAX_DEPTH, NotUnicode (naming where) if a
    key or string is not encodable text, and with `refuse_nul` HasNul (naming where) if one holds a NUL. Iterative:
    no recursion. Where an item sits is kept as its parent's entry and its own key, and spelled out only for a
    refusal: a node's answer may hold a list of 100,000 numbers."""
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        item, depth, at = stack.pop()
        if isinstance(item, str):
            if not item.isascii():  # the common case costs one scan in C
                _check_text(item, at)
            if refuse_nul and "\x00" in item:
                raise HasNul(_where(at))
            continue
        if isinstance(item, dict):
            for key in item:
                if not key.isascii():
                    _check_text(key, (at, key), key=True)
                if refuse_nul and "\x00" in key:
                    raise HasNul(_where((at, key), key=True))
            children: Any = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        if depth > MAX_DEPTH:
            raise TooDeep
        stack.extend((child, depth + 1, (at, key)) for key, child in children if isinstance(child, dict | list | str))
    return value


def _where(at: Any, *, key: bool = False) -> str:
    """`a.b[3]` from the chain (parent, key): an object's member by name (a refused key in ascii()), a list's item
    by index."""
    names = []
    while at is not None:
        at, name = at
        names.append(name)
    where = ""
    for i, name in enumerate(reversed(names)):
        if isinstance(name, int):
            where += f"[{name}]"
        else:
            text = ascii(name) if key and i == len(names) - 1 else name
            where += f".{text}" if where else text
    return where


def _check_text(text: str, at: Any, *, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise NotUnicode(_where(at, key=key)) from None


def _no_constant(name: str) -> Any:
    raise NotANumber(f"JSON holds {name}, which is not a number.")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise NotANumber(f"JSON number {text[:40]} is out of range.")
    return value


def _bounded(text: str) -> int:
    # Checked on the digits first: int() of a 4,000-digit text is itself work, past 4,300 a ValueError.
    if len(text) > 20 or not -INT_LIMIT <= (value := int(text)) < INT_LIMIT:
        raise NotANumber(f"JSON integer {text[:40]}{'…' if len(text) > 40 else ''} is out of range (64 bits).")
    return value


def loads(text: str | bytes, *, refuse_nul: bool = False) -> Any:
    """json.loads whose every refusal is a ValueError (a JSONDecodeError, or Refused: TooDeep, NotUnicode,
    NotANumber, and with `refuse_nul` HasNul)."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite, parse_int=_bounded)
    except RecursionError:
        raise TooDeep from None
    return check_json(value, refuse_nul=refuse_nul)


def answer_loads(text: str | bytes) -> Any:
    """A node's answer: `loads`, and no NUL in any key or string (see the module's note)."""
    return loads(text, refuse_nul=True)
