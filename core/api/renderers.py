"""A JSON renderer with DRF's output, encoded by orjson (issue 14: JSON encoding was a large share of a page of
offers). Used by the hot read paths; everything else keeps DRF's JSONRenderer."""
from collections.abc import Mapping
from typing import Any

import orjson
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.encoders import JSONEncoder

# DRF's encoder turns what orjson does not know (Decimal, lazy strings, timedelta, ...) into what DRF would write;
# datetimes and dataclasses go to it too, because orjson's own forms differ from DRF's ("+00:00" for "Z").
_default = JSONEncoder().default
_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


class FastJSONRenderer(JSONRenderer):
    """Same media type, same JSON as JSONRenderer (compact, UTF-8, U+2028/U+2029 escaped). Floats are written in
    their shortest round-trip form like Python's, but below 1e-4 and from 1e16 on in another notation for the
    same number (0.00001, not 1e-05), and a NaN or infinity is null where JSONRenderer fails. Anything orjson
    refuses (a non-string key, an int over 64 bits) and an indented rendering asked for by the client are
    rendered by JSONRenderer itself."""

    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: Mapping[str, Any] | None = None) -> bytes:
        if data is None:
            return b""
        if self.get_indent(accepted_media_type or "", renderer_context or {}) is None:
            try:
                out = orjson.dumps(data, default=_default, option=_OPTIONS)
            except TypeError:
                pass  # orjson.JSONEncodeError is a TypeError
            else:
                # As JSONRenderer: these two are valid JSON but end a line in JavaScript.
                return out.replace(b"\xe2\x80\xa8", b"\\u2028").replace(b"\xe2\x80\xa9", b"\\u2029")
        return super().render(data, accepted_media_type, renderer_context)
