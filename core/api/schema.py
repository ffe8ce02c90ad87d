"""OpenAPI generation for every app's API: document the error answers, and make the schema as strict as the server.

drf-spectacular documents only the success answer of each operation. Clients (and
the schemathesis run in the test suite) need to know the 4xx answers too, and
the bounds the filters enforce, so that the schema describes what the API does.

A request the schema allows must not be refused for a reason the schema could have said: request bodies whose
serializer refuses unknown fields say `additionalProperties: false`; decimal strings carry a pattern with their
digits and bounds; strings say which characters the server refuses (NUL always, every control character where
the field or the URL refuses them) and that they may not be blank where blank is refused. What remains are
rules no schema can carry: the data (a GPU model from the catalogue, a card of yours), credentials, password
strength, a key that parses.
"""
import copy
import re
from decimal import Decimal
from typing import Any

from django import forms
from django.conf import settings
from django.db.models import Model
from django_filters.filters import Filter
from django_filters.filterset import FilterSet
from drf_spectacular.contrib.django_filters import DjangoFilterExtension
from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.plumbing import ComponentRegistry, ResolvedComponent, force_instance
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers
from rest_framework.authentication import SessionAuthentication

from core.api.fields import StrictFieldsMixin
from core.validators import no_control_characters

# Characters the server refuses, as JSON Schema (ECMA 262) character-class contents.
NUL = r"\u0000"
CONTROL = r"\u0000-\u001f\u007f-\u009f"  # Unicode category Cc, as core/request_guard.py and no_control_characters


def string_pattern(*, refused: str, nonblank: bool) -> str:
    """A pattern for strings without the `refused` characters and, if `nonblank`, with one that is not a space."""
    if nonblank:
        return rf"^[^{refused}]*[^\s{refused}][^{refused}]*$"
    return rf"^[^{refused}]*$"


def _int_range(lo: int, hi: int) -> list[str]:
    """Regex alternatives for the integers lo..hi (lo >= 0) written without leading zeros."""
    out: list[str] = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        first, last = max(lo, 10 ** (digits - 1) if digits > 1 else 0), min(hi, 10**digits - 1)
        if first <= last:
            out += _same_width(str(first), str(last))
    return out


def _same_width(lo: str, hi: str) -> list[str]:
    """Regex alternatives for the digit strings of one width from lo to hi (leading zeros as written)."""
    if lo == hi:
        return [lo]
    common = 0
    while lo[common] == hi[common]:
        common += 1
    prefix, lo, hi = lo[:common], lo[common:], hi[common:]
    if len(lo) == 1:
        return [f"{prefix}[{lo}-{hi}]"]
    rest = len(lo) - 1
    out, tail = [], []
    first_full, last_full = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * rest:
        out += [prefix + lo[0] + alt for alt in _same_width(lo[1:], "9" * rest)]
        first_full += 1
    if hi[1:] != "9" * rest:
        tail = [prefix + hi[0] + alt for alt in _same_width("0" * rest, hi[1:])]
        last_full -= 1
    if first_full <= last_full:
        out.append(f"{prefix}[{first_full}-{last_full}][0-9]{{{rest}}}")
    return out + tail


def _fraction_at_least(digits: str) -> str:
    """Regex for a fraction (`.` and 1..len(digits) digits, or none) worth at least 0.<digits>."""
    places = len(digits)
    if digits == "0" * places:
        return rf"(\.[0-9]{{1,{places}}})?"
    alts = [digits[:i] + f"[{int(d) + 1}-9]" + rf"[0-9]{{0,{places - i - 1}}}"
            for i, d in enumerate(digits) if d != "9"]
    stripped = digits.rstrip("0")
    alts.append(stripped + (f"0{{0,{places - len(stripped)}}}" if len(stripped) < places else ""))
    return rf"\.({'|'.join(alts)})"


def _fraction_at_most(digits: str) -> str:
    """Regex for a fraction (`.` and 1..len(digits) digits, or none) worth at most 0.<digits>."""
    places = len(digits)
    alts = [digits[:i] + f"[0-{int(d) - 1}]" + rf"[0-9]{{0,{places - i - 1}}}"
            for i, d in enumerate(digits) if d != "0"]
    alts += [digits[:i] for i in range(1, places + 1)]
    return rf"(\.({'|'.join(dict.fromkeys(alts))}))?"


def decimal_pattern(*, places: int, whole_digits: int, minimum: Decimal | None, maximum: Decimal | None) -> str:
    """A pattern for plain decimal strings ("12", "0.5") with at most `places` decimals, within the bounds.

    Used for the decimal strings of request bodies (prices, amounts): a client that keeps to the pattern is not
    refused for the number. Only non-negative bounds are encoded; otherwise the pattern bounds the digits only.
    """
    digits_only = rf"^-?[0-9]{{1,{whole_digits}}}(\.[0-9]{{1,{places}}})?$"
    largest = Decimal(10) ** whole_digits - Decimal(1).scaleb(-places)
    if minimum is None or minimum < 0:
        return digits_only
    maximum = largest if maximum is None else min(maximum, largest)
    scale = Decimal(10) ** places
    lo, hi = int(minimum * scale), int(maximum * scale)
    if lo != minimum * scale or hi != maximum * scale:  # bounds finer than the places: not encoded
        return digits_only
    lo_whole, lo_fraction = divmod(lo, 10**places)
    hi_whole, hi_fraction = divmod(hi, 10**places)
    if lo_whole == hi_whole:
        return digits_only
    alts = [str(lo_whole) + _fraction_at_least(str(lo_fraction).zfill(places))]
    middle = _int_range(lo_whole + 1, hi_whole - 1)
    if middle:
        alts.append(f"({'|'.join(middle)})" + rf"(\.[0-9]{{1,{places}}})?")
    alts.append(str(hi_whole) + _fraction_at_most(str(hi_fraction).zfill(places)))
    return f"^({'|'.join(alts)})$".replace("[0-9]{0,0}", "").replace("]{1}", "]")


class ErrorDetailSerializer(serializers.Serializer[Any]):
    """An error that concerns the whole request."""

    detail = serializers.CharField()


class CodedErrorSerializer(ErrorDetailSerializer):
    """An error that concerns the whole request, with a stable `code` a program can act on (where the
    operation's description names one)."""

    code = serializers.CharField(required=False)


def error_response(description: str) -> OpenApiResponse:
    """An operation's {"detail": ...} answer, described in its own words (for extend_schema's `responses`)."""
    return OpenApiResponse(ErrorDetailSerializer, description)


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
    "400": "Malformed or out-of-range input; the body names each field and the problem (`detail`: a control "
           "character, such as NUL, in the URL).",
    "401": "Missing, invalid or revoked API key.",
    "403": "Not allowed (for a browser session: a missing CSRF token).",
    "404": "No such object, or not yours; or a page past the last one.",
    "413": f"The request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.",
    "414": f"The URL (path and query string) is longer than {settings.REQUEST_URL_MAX_CHARS} characters.",
    "415": "Unsupported Content-Type; send JSON.",
    "429": "Too many requests; retry after the time in the Retry-After header.",
}


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's AutoSchema, plus the error answers each operation can give, and request schemas as strict
    as the server."""

    def get_operation(self, path: str, path_regex: str, path_prefix: str, method: str,
                      registry: ComponentRegistry) -> dict[str, Any] | None:
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        for parameter in operation.get("parameters", []):
            schema = parameter.get("schema", {})
            if parameter["in"] not in ("path", "query") or schema.get("type") != "string":
                continue
            # Control characters in the URL are a 400 for every route (core/request_guard.py).
            if schema.get("pattern") == "^[^/]+$":  # a router's lookup (lookup_value_regex)
                schema["pattern"] = f"^{self._not_a_list_action()}[^/{CONTROL}]+$"
            elif not {"enum", "pattern", "format"} & set(schema):
                schema["pattern"] = string_pattern(refused=CONTROL, nonblank=False)
                if parameter["in"] == "path":
                    schema.setdefault("minLength", 1)
        if "requestBody" in operation and getattr(self.get_request_serializer(), "schema_presence", None):
            operation["requestBody"]["required"] = True  # no body is none of the fields that must be there
        responses = operation.setdefault("responses", {})
        for code in self._error_codes(operation):
            if code not in responses:
                responses[code] = self._error_response(code)
        return operation

    def _not_a_list_action(self) -> str:
        """A lookahead that keeps a router's lookup off the viewset's own list-level actions: the lookup takes any
        segment, so /notifications/unread-count/ would also read as the notification "unread-count", which the
        URL never reaches (the action's route comes first)."""
        view = self.view
        try:
            actions: list[Any] = getattr(view, "get_extra_actions", lambda: [])()
        finally:  # it reads the class's members, `schema` among them, which unbinds this inspector from its view
            self.view = view
        # re.escape's "\\-" is no escape ECMA 262 knows (a hyphen outside a class needs none)
        paths = sorted(re.escape(action.url_path).replace("\\-", "-") for action in actions if not action.detail)
        return f"(?!({'|'.join(paths)})$)" if paths else ""

    def _error_codes(self, operation: dict[str, Any]) -> list[str]:
        params = operation.get("parameters", [])
        codes = ["400"]  # any URL may carry a control character (core/request_guard.py)
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
            codes.append("413")  # any body may be too large (core/request_guard.py)
        codes.append("414")  # any URL may be too long (core/request_guard.py)
        if "requestBody" in operation:
            codes.append("415")
        if self.view.get_throttles():
            codes.append("429")
        return codes

    def _map_basic_serializer(self, serializer: Any, direction: str) -> dict[str, Any]:
        schema: dict[str, Any] = super()._map_basic_serializer(serializer, direction)
        if direction != "request":
            return schema
        serializer = force_instance(serializer)
        if isinstance(serializer, StrictFieldsMixin):
            schema["additionalProperties"] = False  # StrictFieldsMixin answers an unknown field with a 400
        # Which fields must be there together, when the serializer's validate() says so (e.g. one of two).
        schema.update(copy.deepcopy(getattr(serializer, "schema_presence", {})))
        for name, field in serializer.fields.items():
            prop = schema.get("properties", {}).get(name)
            if prop is not None and prop.get("type") == "string" and "enum" not in prop:
                self._restrict_string(field, prop)
            values = (prop or {}).get("additionalProperties")
            if isinstance(field, serializers.DictField) and isinstance(values, dict) and values.get("type") == "string":
                self._restrict_string(field.child, values)  # an object's values: e.g. a price per MIG profile
        return schema

    @staticmethod
    def _restrict_string(field: serializers.Field[Any, Any, Any, Any], prop: dict[str, Any]) -> None:
        """The characters and digits a request body's string field takes, as its serializer field checks them."""
        if isinstance(field, serializers.DecimalField):
            assert field.decimal_places is not None and field.max_whole_digits is not None  # ours are bounded
            prop["pattern"] = decimal_pattern(
                places=field.decimal_places, whole_digits=field.max_whole_digits,
                minimum=None if field.min_value is None else Decimal(str(field.min_value)),
                maximum=None if field.max_value is None else Decimal(str(field.max_value)),
            )
            return
        if {"format", "pattern"} & set(prop):  # e-mail addresses, date-times; a RegexValidator's own pattern
            return
        # DRF's CharField refuses NUL; these fields refuse every control character (a related field's: fields.py).
        strict = no_control_characters in field.validators or isinstance(field, serializers.RelatedField)
        nonblank = isinstance(field, serializers.CharField) and field.trim_whitespace and not field.allow_blank
        prop["pattern"] = string_pattern(refused=CONTROL if strict else NUL, nonblank=nonblank)

    def _error_response(self, code: str) -> dict[str, Any]:
        if code != "400":
            response: dict[str, Any] = self._get_response_for_code(
                OpenApiResponse(ErrorDetailSerializer, _DESCRIPTIONS[code]), code)
            return response
        component = ResolvedComponent(
            name="ValidationError", type=ResolvedComponent.SCHEMA, schema=_VALIDATION_ERROR, object="ValidationError"
        )
        self.registry.register_on_missing(component)
        return {"description": _DESCRIPTIONS[code], "content": {"application/json": {"schema": component.ref}}}


class BoundedDjangoFilterExtension(DjangoFilterExtension):
    """django-filter parameters with the bounds the filters enforce (min_value, max_value, max_length)."""

    priority = 1

    def resolve_filter_field(self, auto_schema: SpectacularAutoSchema, model: type[Model] | None,
                             filterset_class: type[FilterSet], field_name: str,
                             filter_field: Filter) -> list[dict[str, Any]]:
        parameters: list[dict[str, Any]] = super().resolve_filter_field(
            auto_schema, model, filterset_class, field_name, filter_field)
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
            if schema.get("type") == "array":
                schema["minItems"] = 1  # `?status=` is a blank value, refused like any other
            for values in (schema, schema.get("items", {})):
                if values.get("type") == "string" and not {"enum", "format", "pattern"} & set(values):
                    # StrictFilterSet refuses a blank value, the request guard a control character.
                    values["pattern"] = string_pattern(refused=CONTROL, nonblank=True)
            if integer and schema.get("type") == "number":
                schema["type"] = "integer"
                schema.pop("format", None)
            for key, value in bounds.items():
                if value is not None:
                    schema[key] = float(value) if schema.get("type") == "number" else int(value)
        return parameters
