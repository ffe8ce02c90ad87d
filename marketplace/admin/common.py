"""What the operators' pages of the marketplace share."""
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError


class NothingEditableAdmin:
    """A ModelAdmin whose change page has no editable field of its model (its changes are its actions, which call
    the services): its Save writes nothing. Django's wrote the whole row back as the page had read it, over what a
    booking, a check, a worker or the owner had changed meanwhile (an instance's status, a key revoked by its owner;
    found by review). Adding, where a page allows it, saves as usual."""

    def save_model(self, request: Any, obj: Any, form: Any, change: bool) -> None:
        if not change:
            super().save_model(request, obj, form, change)  # type: ignore[misc]  # a mixin: ModelAdmin supplies it


# ------------------------------------------------------------------ a page's value, and a change made since it
#
# A change form that writes only what the operator changed (a GPU's status, a provider's payout account) asks the
# field to send back the value the page showed (`show_hidden_initial`): its changed_data then compares the posted
# value with the page's, not with the row as read when the form is sent. Compared with the row, a value changed by
# someone else since the page opened (a health check's lost GPU, the provider's new payout account) counted as the
# operator's change and was written back on a Save that changed nothing (found by review). And as the user page
# does (accounts.UserChangeForm), a save whose value differs from one changed since the page opened is refused on
# the form, nothing saved: the operator decided on a value that is no longer there, and is told what it is now.

NOT_SENT = object()


def page_value(form: Any, name: str) -> Any:
    """The value the page showed for the field (its hidden initial), as the field reads it; NOT_SENT when the post
    carries none (a client that sends no page's value claims none: its value is judged as sent)."""
    field, bound = form.fields[name], form[name]
    if bound.html_initial_name not in form.data:
        return NOT_SENT
    try:
        return field.to_python(field.hidden_widget().value_from_datadict(form.data, form.files,
                                                                         bound.html_initial_name))
    except ValidationError:
        return NOT_SENT


def refuse_stale_value(form: Any, name: str, now: Callable[[Any], str]) -> bool:
    """Refuse on the form (True) a save of a field whose stored value moved since the page showed it, when the
    posted value differs from the stored one (it would undo that change, or be taken for the operator's decision
    over it). One that agrees with the stored value is saved: nothing of it is written. Only after the fields are
    cleaned; `now` words the stored value for the message."""
    field = form.fields.get(name)
    if field is None or field.disabled or not field.show_hidden_initial or name not in form.cleaned_data:
        return False
    seen, stored = page_value(form, name), form.get_initial_for_field(field, name)
    if seen is NOT_SENT or seen == stored or form.cleaned_data[name] == stored:
        return False
    form.add_error(name, f"Changed by someone else since you opened this page: it is {now(stored)} now. Nothing was "
                         "saved; reload the page, and make your change again if it still holds.")
    return True


def to_write(form: Any, name: str) -> bool:
    """The operator changed the field from the page's value, to one the row does not hold (a value that agrees with
    the stored one writes nothing). Only after the fields are cleaned, and not when refuse_stale_value refused."""
    field = form.fields.get(name)
    if field is None or field.disabled or name not in form.changed_data or name not in form.cleaned_data:
        return False
    return form.cleaned_data[name] != form.get_initial_for_field(field, name)
