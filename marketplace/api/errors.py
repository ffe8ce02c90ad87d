"""Turn domain exceptions into 4xx answers; everything else keeps DRF's handling. Every error answer is JSON,
whatever the view renders otherwise (the API docs' HTML, the schema's YAML) or the client asked for; an
unexpected exception is left to Django (logged, then config.views.server_error's JSON 500)."""
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, status
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from marketplace.models import InvalidTransition
from marketplace.services.instances import InstanceError
from marketplace.services.nodes import NodeConflict
from marketplace.services.ssh_keys import InvalidSshKey, SshKeyConflict

CONFLICTS = (InvalidTransition, NodeConflict, SshKeyConflict)


def exception_handler(exc, context):
    response = _handle(exc, context)
    request = context.get("request")
    if response is not None and request is not None:
        # APIView.finalize_response renders with the request's renderer: make it JSON for errors.
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = JSONRenderer.media_type
    return response


def _handle(exc, context):
    if isinstance(exc, CONFLICTS):
        return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, InstanceError):
        # 400 names the field at fault, like a serializer's error; 409 and 422 concern the request as a whole.
        body = {exc.field: [exc.message]} if exc.field and exc.status_code == 400 else {"detail": exc.message}
        return Response(body, status=exc.status_code)
    if isinstance(exc, InvalidSshKey):
        return Response({"public_key": [str(exc)]}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        exc = exceptions.ValidationError(detail)
    return drf_exception_handler(exc, context)
