"""The Idempotency-Key header at the API edge: its OpenAPI description and its parsing."""
from drf_spectacular.utils import OpenApiParameter
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request

from core.idempotency import IDEMPOTENCY_HEADER, IDEMPOTENCY_KEY_RE, request_fingerprint


def idempotency_parameter(description: str) -> OpenApiParameter:
    return OpenApiParameter(
        IDEMPOTENCY_HEADER, {"type": "string", "minLength": 1, "maxLength": 100, "pattern": r"^[!-~]+$"},
        OpenApiParameter.HEADER, description=description,
    )


def idempotency_key(request: Request) -> tuple[str, str]:
    """(the key, the fingerprint of the body), both "" when the header is absent; 400 for a malformed key."""
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return "", ""
    if not IDEMPOTENCY_KEY_RE.fullmatch(key):
        raise ValidationError({IDEMPOTENCY_HEADER: ["Must be 1 to 100 printable ASCII characters."]})
    return key, request_fingerprint(request.data)
