"""Serializer building blocks shared by the marketplace's endpoints."""
import unicodedata
from decimal import Decimal

from rest_framework import serializers

from marketplace.money import micros_to_usd


class StrictFieldsMixin:
    """Reject fields a client sends that this serializer does not accept.

    DRF silently drops them, which hides typos ("prize") and attempts to change
    read-only fields; a 400 that names them is kinder.
    """

    def to_internal_value(self, data):
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = sorted(set(data) - writable)
            if unknown:
                readable = set(self.fields)
                raise serializers.ValidationError(
                    {
                        name: ["This field cannot be changed here." if name in readable else "Unknown field."]
                        for name in unknown
                    }
                )
        return super().to_internal_value(data)


def no_control_characters(value: str) -> None:
    if any(unicodedata.category(ch) == "Cc" for ch in value):
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
