"""Answers that carry a secret shown once must not be kept by any cache."""
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response


class NoStoreMixin:
    """For the API views whose answers carry a secret shown once (a new API key, a webhook endpoint's signing
    secret, a Stripe SetupIntent's client_secret): every answer says Cache-Control: no-store, so that no browser,
    proxy or client cache keeps a copy a stranger could read later, as the pages that show such secrets do."""

    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        response["Cache-Control"] = "no-store"
        return response
