"""`Authorization: Bearer <api key>` authentication, and its OpenAPI description.

A key authenticates a request only for what its scopes allow on the view it reaches (core/api/scopes.py): the
check is here, where every request with a key passes, rather than in each view's permissions, so that no view can
leave it out. An expired key is a 401 that says it expired; a key without the scope the view needs, a 403 naming
the scope.
"""
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from core.api.scopes import ALL_SCOPES, SCOPE_LABELS, is_rule, missing_scopes, read_methods_of, refusal
from marketplace.services.accounts import ApiKeyExpired, api_key_authenticate


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = b"bearer"

    def authenticate(self, request):
        parts = authentication.get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header: expected 'Bearer <api key>'.")
        try:
            raw_key = parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("The API key contains characters no key has.") from None
        try:
            api_key = api_key_authenticate(raw_key=raw_key)
        except ApiKeyExpired as exc:
            raise exceptions.AuthenticationFailed(
                f"This API key expired at {exc.key.expires_at:%Y-%m-%d %H:%M} UTC: make a new one.") from None
        if api_key is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked API key.")
        self._check_scope(request, api_key)
        return api_key.user, api_key

    @staticmethod
    def _check_scope(request, api_key) -> None:
        view = (getattr(request, "parser_context", None) or {}).get("view")
        rule = getattr(view, "api_scope", None)
        if not is_rule(rule):  # tests/marketplace/test_api_scopes.py makes every API view declare one
            raise exceptions.PermissionDenied("This endpoint declares no API key scope: only a logged-in browser "
                                              "session may use it.")
        missing = missing_scopes(scopes=api_key.scopes, rule=rule, method=request.method,
                                 read_methods=read_methods_of(view))
        if missing:
            raise exceptions.PermissionDenied(refusal(scopes=api_key.scopes, method=request.method, missing=missing))

    def authenticate_header(self, request):
        return 'Bearer realm="api"'


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "marketplace.api.authentication.ApiKeyAuthentication"
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        scopes = "; ".join(f"`{s}` ({SCOPE_LABELS[s]})" for s in ALL_SCOPES)
        return {"type": "http", "scheme": "bearer",
                "description": "An API key from /api/v1/auth/confirm/ (sign-up), /login/ or POST /api/v1/api-keys/. "
                               f"A key holds one or more scopes: {scopes}. `read` allows safe methods everywhere. "
                               "A request outside the key's scopes is a 403 naming the scope it needs; a key past "
                               "its `expires_at` is a 401."}

