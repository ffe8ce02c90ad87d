"""`Authorization: Bearer <api key>` authentication, and its OpenAPI description."""
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from marketplace.services.accounts import api_key_authenticate


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
        api_key = api_key_authenticate(raw_key=raw_key)
        if api_key is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked API key.")
        return api_key.user, api_key

    def authenticate_header(self, request):
        return 'Bearer realm="api"'


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "marketplace.api.authentication.ApiKeyAuthentication"
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "An API key from /api/v1/auth/confirm/ (sign-up) or /login/."}
