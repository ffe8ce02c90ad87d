"""Input rules that are no app's own, defined once for the API's serializer fields and the pages' form fields.

They raise Django's ValidationError: a form shows its message, and DRF reports it as the field's error;
whole_number answers None and its caller names the field in its own error.
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


def whole_number(text: object, *, low: int, high: int) -> int | None:
    """`text` as an int when it is ASCII digits only (no sign, space or "_") spelling a number from `low` to `high`
    (0 <= low <= high), else None.

    The digits are counted before int() converts them: Python refuses a string of more than 4300 digits (a
    ValueError, sys.get_int_max_str_digits), and no number within the bounds is written with more digits than
    `high` has ("0" * 4400 + "5" too is refused). str.isdigit alone takes "²", which int() refuses."""
    if not isinstance(text, str) or not (text.isascii() and text.isdigit()) or len(text) > len(str(high)):
        return None
    value = int(text)
    return value if low <= value <= high else None
