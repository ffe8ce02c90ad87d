"""JSON from clients, read once for the API's bodies and for JSON carried in query parameters (/compat/vast).

Python's json raises RecursionError, not ValueError, on deeply nested input ("[" * 3000), and DRF's JSONParser
catches only ValueError: a 500 on every endpoint, before authentication. Here that is a 400, and so is nesting
deeper than MAX_DEPTH, which still parses but could exhaust the stack later (repr in an error message,
json.dumps in a JSONField, the database driver). No input of this platform is nested nearly that deep.
"""
import json
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

MAX_DEPTH = 64
TOO_DEEP = f"JSON nested deeper than {MAX_DEPTH} levels."


class TooDeep(ValueError):
    def __init__(self) -> None:
        super().__init__(TOO_DEEP)


def check_depth(value: Any) -> Any:
    """`value` itself, or TooDeep if its lists and objects nest deeper than MAX_DEPTH (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_DEPTH:
            raise TooDeep
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value


def loads(text: str | bytes) -> Any:
    """json.loads whose every refusal is a ValueError (a JSONDecodeError, or TooDeep)."""
    try:
        return check_depth(json.loads(text))
    except RecursionError:
        raise TooDeep from None


class JSONParser(parsers.JSONParser):
    """DRF's JSONParser, with too deep a body a ParseError (400) like any malformed one."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return check_depth(super().parse(stream, media_type, parser_context))
        except (RecursionError, TooDeep):
            raise ParseError(f"JSON parse error - {TOO_DEEP}") from None
