"""OpenAPI generation: document the error answers and the bounds of query parameters.

drf-spectacular documents only the success answer of each operation. Clients (and
the schemathesis run in the test suite) need to know the 4xx answers too, and
the bounds the filters enforce, so that the schema describes what the API does.
"""
from django import forms
from drf_spectacular.contrib.django_filters import DjangoFilterExtension
from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers
from rest_framework.authentication import SessionAuthentication


class ErrorDetailSerializer(serializers.Serializer):
    """An error that concerns the whole request."""

    detail = serializers.CharField()


_VALIDATION_ERROR = {
    "type": "object",
    "additionalProperties": {
        "oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}],
    },
    "description": (
        "Messages per field (or query parameter) that was rejected; `detail` or `non_field_errors` "
        "for a problem with the request as a whole."
    ),
}
_DESCRIPTIONS = {
    "400": "Malformed or out-of-range input; the body names each field and the problem.",
    "401": "Missing, invalid or revoked API key.",
    "403": "Not allowed (for a browser session: a missing CSRF token).",
    "404": "No such object, or not yours; or a page past the last one.",
    "415": "Unsupported Content-Type; send JSON.",
    "429": "Too many requests; retry after the time in the Retry-After header.",
}


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's AutoSchema, plus the error answers each operation can give."""

    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        responses = operation.setdefault("responses", {})
        for code in self._error_codes(operation):
            if code not in responses:
                responses[code] = self._error_response(code)
        return operation

    def _error_codes(self, operation) -> list[str]:
        params = operation.get("parameters", [])
        codes = []
        if "requestBody" in operation or any(p["in"] == "query" for p in params):
            codes.append("400")
        authenticators = self.view.get_authenticators()
        if authenticators:
            codes.append("401")
            if any(isinstance(a, SessionAuthentication) for a in authenticators) and self.method not in (
                "GET", "HEAD", "OPTIONS"
            ):
                codes.append("403")
        paginated = self._is_list_view() and self._get_paginator() is not None
        if any(p["in"] == "path" for p in params) or paginated:
            codes.append("404")
        if "requestBody" in operation:
            codes.append("415")
        if self.view.get_throttles():
            codes.append("429")
        return codes

    def _error_response(self, code: str) -> dict:
        if code != "400":
            return self._get_response_for_code(OpenApiResponse(ErrorDetailSerializer, _DESCRIPTIONS[code]), code)
        component = ResolvedComponent(
            name="ValidationError", type=ResolvedComponent.SCHEMA, schema=_VALIDATION_ERROR, object="ValidationError"
        )
        self.registry.register_on_missing(component)
        return {"description": _DESCRIPTIONS[code], "content": {"application/json": {"schema": component.ref}}}


class BoundedDjangoFilterExtension(DjangoFilterExtension):
    """django-filter parameters with the bounds the filters enforce (min_value, max_value, max_length)."""

    priority = 1

    def resolve_filter_field(self, auto_schema, model, filterset_class, field_name, filter_field):
        parameters = super().resolve_filter_field(auto_schema, model, filterset_class, field_name, filter_field)
        form_field = filter_field.field_class  # forms.DecimalField and FloatField subclass IntegerField
        integer = issubclass(form_field, forms.IntegerField) and not issubclass(
            form_field, (forms.DecimalField, forms.FloatField)
        )
        bounds = {
            "minimum": filter_field.extra.get("min_value"),
            "maximum": filter_field.extra.get("max_value"),
            "maxLength": filter_field.extra.get("max_length"),
        }
        for parameter in parameters:
            schema = parameter["schema"]
            if integer and schema.get("type") == "number":
                schema["type"] = "integer"
                schema.pop("format", None)
            for key, value in bounds.items():
                if value is not None:
                    schema[key] = float(value) if schema.get("type") == "number" else int(value)
        return parameters
