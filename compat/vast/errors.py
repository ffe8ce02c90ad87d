"""The one mapping of errors for the Vast-compatible API: the API's own (core.api.errors, which maps
core.errors.ApplicationError) rewritten into the body the `vastai` CLI prints, `{"success": false, "msg": ...}`."""
from typing import Any

from rest_framework.response import Response

from core.api.errors import exception_handler as api_exception_handler
from core.errors import ApplicationError


def flatten(detail: Any) -> str:
    """DRF's error detail ({"field": ["msg"]}, ["msg"], "msg") as one line a person reads."""
    if isinstance(detail, dict):
        parts = []
        for key, value in detail.items():
            text = flatten(value)
            parts.append(text if key in ("detail", "non_field_errors", "msg") else f"{key}: {text}")
        return "; ".join(parts)
    if isinstance(detail, list | tuple):
        return " ".join(flatten(item) for item in detail)
    return str(detail)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    response = api_exception_handler(exc, context)
    if response is None:
        return None  # unexpected: Django's JSON 500 (config.views), logged
    # A domain refusal's message is already written for a person (and names its field); DRF's own errors
    # (a bad key, a body that is no JSON) are flattened.
    text = exc.message if isinstance(exc, ApplicationError) else flatten(response.data)
    code = getattr(exc, "code", None) or getattr(exc, "default_code", None) or "error"
    response.data = {"success": False, "error": str(code), "msg": text}
    return response
