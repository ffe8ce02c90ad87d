"""Serializer building blocks every app's API shares: strict input (no unknown fields, the documented JSON types)
and the money fields (micro-dollars shown as decimals; whole cents parsed by core.money.parse_cents)."""
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.http import QueryDict
from rest_framework import serializers
from rest_framework.settings import api_settings

from core.money import CENTS_MAX_DIGITS, CENTS_PLACES, USD_MAX_DIGITS, USD_PLACES, micros_to_usd, parse_cents
from core.request_guard import has_control_character
from core.validators import CONTROL_CHARACTERS_MESSAGE

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


def _json_type_error(field: serializers.Field[Any, Any, Any, Any], value: object) -> str | None:
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


def _lookup_error(field: serializers.Field[Any, Any, Any, Any], value: object) -> str | None:
    # A related field looks its value up in the database, and PostgreSQL refuses NUL in text (a 500): no slug
    # or id has a control character, so none is looked up.
    if isinstance(field, serializers.RelatedField) and isinstance(value, str) and has_control_character(value):
        return CONTROL_CHARACTERS_MESSAGE
    return None


if TYPE_CHECKING:
    _SerializerBase = serializers.Serializer[Any]  # the mixin's methods run on a serializer
else:
    _SerializerBase = object


class StrictFieldsMixin(_SerializerBase):
    # Reject fields a client sends that this serializer does not accept: DRF silently drops
    # them, which hides typos ("prize") and attempts to change read-only fields; a 400 that
    # names them is kinder. `read_only_elsewhere` lists the resource's fields that this input
    # serializer does not take, so that they are reported as read-only, not as unknown.
    # Values of a JSON body must have the JSON type that the schema documents.
    # (A comment, not a docstring: drf-spectacular would publish a docstring as the
    # description of every request body.)

    def to_internal_value(self, data: Any) -> Any:
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


class UsdField(serializers.DecimalField):
    """USD amounts as decimal strings with six places, backed by integer micro-dollars."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_digits", USD_MAX_DIGITS)
        kwargs.setdefault("decimal_places", USD_PLACES)
        super().__init__(**kwargs)

    def to_representation(self, value: Decimal | int) -> str:
        if isinstance(value, int):
            value = micros_to_usd(value)
        return super().to_representation(Decimal(value))


class MoneyField(UsdField):
    """USD with six places, like prices, but room for balances and totals up to $999,999,999,999."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_digits", 18)
        super().__init__(**kwargs)


class CentsField(serializers.DecimalField):
    """USD in whole cents as a plain decimal string ("25" or "25.00"): no exponents, no more places."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_digits", CENTS_MAX_DIGITS)
        kwargs.setdefault("decimal_places", CENTS_PLACES)
        super().__init__(**kwargs)

    def to_internal_value(self, data: int | float | str | Decimal) -> Decimal:
        if isinstance(data, str):
            try:
                parse_cents(data)
            except ValueError:
                self.fail("invalid")
        return super().to_internal_value(data)
