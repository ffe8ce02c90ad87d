"""Form fields shared by the pages."""
from django import forms


class TextareaField(forms.CharField):
    """A textarea's text with its line breaks as LF, before max_length is checked.

    A browser sends each line break of a textarea as CRLF, yet counts it as one character against the field's
    maxlength (the HTML spec's "API value"), as the API counts a JSON "\\n". Checked as sent, a 16,000-character
    on-start script of 1,230 lines arrived as 17,230 characters and was refused though the API takes it (found by
    review). Every textarea with a max_length on the pages is one of these (tests/web/test_textarea_lengths.py)."""

    widget = forms.Textarea

    def to_python(self, value):
        value = super().to_python(value)
        return value.replace("\r\n", "\n") if isinstance(value, str) else value
