"""JSON from clients, read once for the API's bodies (core.untrusted_json says what is refused and why)."""
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

from core.untrusted_json import TOO_DEEP, Refused, check_json


class JSONParser(parsers.JSONParser):
    """DRF's JSONParser, with too deep a body, or one that is not Unicode, a ParseError (400) like any malformed
    one."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return check_json(super().parse(stream, media_type, parser_context))
        except RecursionError:
            raise ParseError(f"JSON parse error - {TOO_DEEP}") from None
        except Refused as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
