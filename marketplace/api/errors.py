"""Turn domain exceptions into 4xx answers; everything else keeps DRF's handling."""
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from marketplace.models import InvalidTransition
from marketplace.services.nodes import NodeConflict

CONFLICTS = (InvalidTransition, NodeConflict)


def exception_handler(exc, context):
    if isinstance(exc, CONFLICTS):
        return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        exc = exceptions.ValidationError(detail)
    return drf_exception_handler(exc, context)
