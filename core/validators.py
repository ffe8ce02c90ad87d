"""Input rules that are no app's own, defined once for the API's serializer fields and the pages' form fields.

They raise Django's ValidationError: a form shows its message, and DRF reports it as the field's error.
"""
from django.core.exceptions import ValidationError

from core.request_guard import has_control_character

CONTROL_CHARACTERS_MESSAGE = "Control characters are not allowed."


def no_control_characters(value: str) -> None:
    """Refuse NUL and every other control character (Unicode category Cc) in what a person names or writes.

    core.api.schema recognises this validator on a field and publishes the refused characters.
    """
    if has_control_character(value):
        raise ValidationError(CONTROL_CHARACTERS_MESSAGE, code="invalid")
