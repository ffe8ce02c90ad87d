"""Serializer building blocks shared by the marketplace's endpoints."""
import unicodedata
from decimal import Decimal

from django.http import QueryDict
from rest_framework import serializers
from rest_framework.settings import api_settings

from marketplace.money import micros_to_usd

# JSON types each kind of field accepts in a JSON body. DRF coerces (1 -> "1", "22" -> 22,
# "yes" -> True), so a client sending the wrong type would never learn it; the schema
# promises these types, and a value of another type is a 400 that names the field.
_JSON_TYPES: list[tuple[type, tuple[type, ...], str]] = [
    (serializers.BooleanField, (bool,), "true or false"),
    (serializers.IntegerField, (int,), "an integer"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.DecimalField, (str,), 'a decimal number in a string, e.g. "0.79"'),
    (serializers.CharField, (str,), "a string"),
    (serializers.MultipleChoiceField, (list,), "a list"),  # before ChoiceField, its base class
    (serializers.ChoiceField, (str,), "a string"),
    (serializers.SlugRelatedField, (str,), "a string"),
]


def _json_type_error(field, value) -> str | None:
    coerce_to_string = getattr(field, "coerce_to_string", api_settings.COERCE_DECIMAL_TO_STRING)
    if isinstance(field, serializers.DecimalField) and not coerce_to_string:
        return _json_type_error(serializers.FloatField(), value)  # documented as a JSON number
    for field_class, types, expected in _JSON_TYPES:
        if isinstance(field, field_class):
            is_bool = isinstance(value, bool)  # bool is a subclass of int
            if value is None or (isinstance(value, types) and (bool in types or not is_bool)):
                return None  # None: DRF's own "may not be null" applies
            return f"Must be {expected}."
    return None


def _lookup_error(field, value) -> str | None:
    # A related field looks its value up in the database, and PostgreSQL refuses NUL in text (a 500): no slug
    # or id has a control character, so none is looked up.
    if isinstance(field, serializers.RelatedField) and isinstance(value, str) and _has_control_character(value):
        return "Control characters are not allowed."
    return None


def _has_control_character(value: str) -> bool:
    return any(unicodedata.category(ch) == "Cc" for ch in value)


class StrictFieldsMixin:
    # Reject fields a client sends that this serializer does not accept: DRF silently drops
    # them, which hides typos ("prize") and attempts to change read-only fields; a 400 that
    # names them is kinder. `read_only_elsewhere` lists the resource's fields that this input
    # serializer does not take, so that they are reported as read-only, not as unknown.
    # Values of a JSON body must have the JSON type that the schema documents.
    # (A comment, not a docstring: drf-spectacular would publish a docstring as the
    # description of every request body.)

    def to_internal_value(self, data):
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = sorted(set(data) - writable)
            if unknown:
                readable = set(self.fields) | set(getattr(self, "read_only_elsewhere", ()))
                raise serializers.ValidationError(
                    {
                        name: ["This field cannot be changed here." if name in readable else "Unknown field."]
                        for name in unknown
                    }
                )
            if not isinstance(data, QueryDict):  # a parsed JSON object; form data is all strings
                wrong = {name: _json_type_error(self.fields[name], value) or _lookup_error(self.fields[name], value)
                         for name, value in data.items()}
                if any(wrong.values()):
                    raise serializers.ValidationError({name: [msg] for name, msg in wrong.items() if msg})
        return super().to_internal_value(data)


def no_control_characters(value: str) -> None:
    if _has_control_character(value):
        raise serializers.ValidationError("Control characters are not allowed.")


class UsdField(serializers.DecimalField):
    """USD amounts as decimal strings with six places, backed by integer micro-dollars."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_digits", 12)
        kwargs.setdefault("decimal_places", 6)
        super().__init__(**kwargs)

    def to_representation(self, value):
        if isinstance(value, int):
            value = micros_to_usd(value)
        return super().to_representation(Decimal(value))
