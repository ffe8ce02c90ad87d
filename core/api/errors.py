"""The one mapping of domain errors to API answers; everything else keeps DRF's handling.

An ApplicationError is answered with its `status_code`: a 400 that names a field as a serializer would
({field: [message]}), anything else as {"detail": message} plus the error's `extra` members (a failed top-up's
id). Every error answer is JSON, whatever the view renders otherwise (the API docs' HTML, the schema's YAML) or
the client asked for; an unexpected exception is left to Django (logged, then config.views.server_error's JSON
500).
"""
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from core.errors import ApplicationError, ValidationFailed


def error_body(exc: ApplicationError) -> dict[str, Any]:
    """The JSON body of an ApplicationError's answer."""
    if isinstance(exc, ValidationFailed) and exc.errors:
        return dict(exc.errors)  # like a serializer's errors: every field at fault
    if exc.field and exc.status_code == 400:
        # Like a serializer's error; 402, 409, 422... concern the request as a whole.
        return {exc.field: [exc.message]}
    return {"detail": exc.message, **exc.extra}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    response = _handle(exc, context)
    request = context.get("request")
    if response is not None and request is not None:
        # APIView.finalize_response renders with the request's renderer: make it JSON for errors.
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = JSONRenderer.media_type
    return response


def _handle(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ApplicationError):
        return Response(error_body(exc), status=exc.status_code)
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        exc = exceptions.ValidationError(detail)
    return drf_exception_handler(exc, context)
