"""What every endpoint of compat/vast shares: authentication as /api/v1's (an API key as `Authorization:
Bearer`), the errors mapped once (compat.vast.errors), body parsing, and the answer to what is not supported.
None of these views is in the published schema (`schema = None`)."""
from typing import Any

from rest_framework import exceptions, permissions
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api.parsers import JSONParser
from core.api.scopes import PUBLIC
from core.errors import ValidationFailed
from core.request_guard import has_control_character
from core.validators import CONTROL_CHARACTERS_MESSAGE
from marketplace.api.authentication import ApiKeyAuthentication
from marketplace.models import User
from marketplace.validators import NAME_MAX_LENGTH

from ..errors import exception_handler


class ApiKeyInUrl(exceptions.AuthenticationFailed):
    default_code = "api_key_in_url"


API_KEY_IN_URL = ("An API key in the URL (`?api_key=`) is not accepted: send it in the `Authorization: Bearer <key>` "
                  "header (vastai 1.9.1 does). A key sent in a URL may have been written to access logs on the way: "
                  "rotate it (make a new key, delete this one).")


class VastApiKeyAuthentication(ApiKeyAuthentication):
    """/api/v1's Bearer key; a request with no such header but an `api_key` query parameter (how older Vast clients
    send it) gets a 401 that says where the key goes, rather than DRF's bare "credentials were not provided" (found
    by review). The query's key is never used: it has been logged by every proxy the URL passed."""

    def authenticate(self, request):
        found = super().authenticate(request)
        if found is None and "api_key" in request.query_params:
            raise ApiKeyInUrl(API_KEY_IN_URL)
        return found


class VastView(APIView):
    authentication_classes = [VastApiKeyAuthentication]
    permission_classes = [permissions.IsAuthenticated]
    parser_classes = [JSONParser]
    renderer_classes = [JSONRenderer]
    schema = None  # not part of the published API

    def get_exception_handler(self):
        return exception_handler


def _user(request: Request) -> User:
    user = request.user
    assert isinstance(user, User)  # every view but the offers search and the 404 requires a key
    return user


def _epoch(moment) -> float | None:
    return moment.timestamp() if moment else None


def _body(request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise ValidationFailed("The body is a JSON object.")
    return request.data


def _refuse_unknown(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValidationFailed(f"Not supported here: {', '.join(unknown)} (supported: {', '.join(sorted(allowed))}).")


def _label(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > NAME_MAX_LENGTH:
        raise ValidationFailed(f"A label is text of at most {NAME_MAX_LENGTH} characters.", field="label")
    if has_control_character(value):
        raise ValidationFailed(CONTROL_CHARACTERS_MESSAGE, field="label")
    return value



# ------------------------------------------------------------------------------------------------ the rest


class UnsupportedView(VastView):
    """Every other path: a JSON 404 the CLI prints, naming what is missing."""

    api_scope = PUBLIC  # core/api/scopes.py
    permission_classes = [permissions.AllowAny]

    def _answer(self, request, *args, **kwargs):
        return Response({"success": False, "error": "not_supported",
                         "msg": f"{request.method} {request.path_info} is not part of this platform's Vast.ai "
                                f"compatible API (docs/vast-cli.md lists what is)."}, status=404)

    get = post = put = patch = delete = _answer
