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
"""
import json
from typing import Any

MAX_DEPTH = 64
TOO_DEEP = f"JSON nested deeper than {MAX_DEPTH} levels."
NOT_UNICODE = "JSON text holds an unpaired UTF-16 surrogate (an escape such as \\ud800 alone), which is not Unicode."


class Refused(ValueError):
    """JSON that parses but is refused (its message says why)."""


class TooDeep(Refused):
    def __init__(self) -> None:
        super().__init__(TOO_DEEP)


class NotUnicode(Refused):
    def __init__(self, where: str = "") -> None:
        super().__init__(f"{NOT_UNICODE[:-1]}, at `{where[:100]}`." if where else NOT_UNICODE)


def check_json(value: Any) -> Any:
    """`value` itself; TooDeep if its lists and objects nest deeper than MAX_DEPTH, NotUnicode (naming where) if a
    key or string is not encodable text. Iterative: no recursion."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            _check_text(item, where)
            continue
        if isinstance(item, dict):
            for key in item:
                _check_text(key, f"{where}.{key!a}" if where else ascii(key))
            children: Any = ((child, f"{where}.{key}" if where else key) for key, child in item.items())
        elif isinstance(item, list):
            children = ((child, f"{where}[{i}]") for i, child in enumerate(item))
        else:
            continue
        if depth > MAX_DEPTH:
            raise TooDeep
        stack.extend((child, depth + 1, at) for child, at in children if isinstance(child, dict | list | str))
    return value


def _check_text(text: str, where: str) -> None:
    if not text.isascii():  # the common case costs one scan in C
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise NotUnicode(where) from None


def loads(text: str | bytes) -> Any:
    """json.loads whose every refusal is a ValueError (a JSONDecodeError, or Refused: TooDeep, NotUnicode)."""
    try:
        return check_json(json.loads(text))
    except RecursionError:
        raise TooDeep from None
