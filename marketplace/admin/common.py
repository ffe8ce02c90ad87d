"""What the operators' pages of the marketplace share."""
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.utils.text import capfirst

# The staff-account rule lives in core so that services enforce it too (billing.services.refunds); the admin
# modules import it from here.
from core.staff import STAFF_ACCOUNT_REFUSED, staff_of_a_non_superuser  # noqa: F401


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


# ------------------------------------------------------------------ a page's set (groups, permissions)
#
# A many-to-many field (a user's groups and permissions, a group's permissions) was written back as the page showed
# it: Django sets the relation to the posted list, so a page opened before another operator revoked a permission or
# took a user out of a group gave it back on a Save made for anything else, the address say (found by review). The
# page now sends the set it showed (a hidden initial) and the save makes only the operator's own change to it, what
# they added and what they took away from the page's set, to the set as it is stored: what was added or taken away
# meanwhile stays so. The operator is told when the set had moved (PageSetsAdmin).


class PageSetInput(forms.MultipleHiddenInput):
    """The page's set, with one empty value more: an empty set would send nothing, which says no page's value (a
    client that sends none has its set written as sent, as Django does)."""

    def format_value(self, value):
        return [*super().format_value(value), ""]

    def value_from_datadict(self, data, files, name):
        values = super().value_from_datadict(data, files, name)
        if values is None:
            return []
        return [value for value in ([values] if isinstance(values, str) else values) if value != ""]


class PageSetsForm:
    """A model form mixin: the many-to-many fields named in `page_sets` carry the page's set and the save applies the
    operator's difference from it (added, taken away) to the stored set. Adding an object sets them as sent."""

    page_sets: tuple[str, ...] = ()
    moved_sets: list[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moved_sets = []
        form: Any = self
        if form.instance.pk is None:
            return
        for name in self.page_sets:
            field = form.fields.get(name)
            if field is not None and not field.disabled and field.to_field_name is None:
                field.show_hidden_initial = True
                field.hidden_widget = PageSetInput

    def page_and_posted_sets(self, name: str) -> tuple[set, set] | None:
        """The keys of the page's set and of the posted one, or None when the field is not the form's to write this
        way (absent, read-only, not cleaned, or no page's set sent)."""
        form: Any = self
        field = form.fields.get(name)
        if (field is None or field.disabled or not field.show_hidden_initial or name not in form.cleaned_data
                or form[name].html_initial_name not in form.data):
            return None
        key = field.queryset.model._meta.pk
        seen = set()
        for raw in field.hidden_widget().value_from_datadict(form.data, form.files, form[name].html_initial_name):
            try:
                seen.add(key.to_python(raw))
            except ValidationError:
                continue  # not a key: nothing the page showed
        return seen, {obj.pk for obj in form.cleaned_data[name]}

    def _save_m2m(self) -> None:
        form: Any = self
        changes = {name: sets for name in self.page_sets if (sets := self.page_and_posted_sets(name)) is not None}
        everything = form.cleaned_data
        form.cleaned_data = {name: value for name, value in everything.items() if name not in changes}
        try:
            super()._save_m2m()  # type: ignore[misc]  # the other relations, as Django writes them
        finally:
            form.cleaned_data = everything
        for name, (seen, posted) in changes.items():
            related = getattr(form.instance, name)
            stored = set(related.values_list("pk", flat=True))
            if stored != seen:
                self.moved_sets.append(name)
            if removed := (seen - posted) & stored:  # what the operator took away, where it still is
                related.remove(*removed)
            if added := (posted - seen) - stored:  # what the operator added, where it is not yet
                related.add(*added)


class PageSetsAdmin:
    """A ModelAdmin whose form is a PageSetsForm: the operator is told when a set had moved since the page opened
    (only their own change to it was made)."""

    def save_related(self, request: Any, form: Any, formsets: Any, change: bool) -> None:
        super().save_related(request, form, formsets, change)  # type: ignore[misc]  # a mixin: ModelAdmin's
        for name in getattr(form, "moved_sets", []):
            messages.warning(request, f"{capfirst(form.fields[name].label)}: changed by someone else since you opened "
                                      "the page. Only your own change to them was made (what you added or took "
                                      "away); what was changed meanwhile stays so.")


# ------------------------------------------------------------------ a page whose every field the operator may change
#
# Django's change form writes every field of the page as the page showed it: a catalogue image another operator took
# off (active unticked) was put back on the offers by a Save made for its description (found by review). Every
# editable field of an OwnChangesForm carries the page's value; a field whose stored value moved since the page
# showed it is refused on the form when the posted value differs from the stored one (nothing saved, the operator
# told what it is now), and the save writes only the columns the operator changed (OwnChangesAdmin); the sets as
# PageSetsForm writes them.


def worded(stored: Any) -> str:
    """A stored value for the refusal's message."""
    if isinstance(stored, bool):
        return "on" if stored else "off"
    return "empty" if stored in (None, "") else f"“{stored}”"


class OwnChangesForm(PageSetsForm):
    """A model form mixin (before forms.ModelForm): its Save writes only what the operator changed from the page,
    refused where that is no longer what is stored. Adding an object saves as usual."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        form: Any = self
        if form.instance.pk is None:
            return
        for name, field in form.fields.items():
            if not field.disabled and name not in self.page_sets:
                field.show_hidden_initial = True

    def _columns(self) -> list[str]:
        form: Any = self
        model_fields = {f.name for f in form._meta.model._meta.concrete_fields if not f.primary_key}
        return [name for name in form.fields if name in model_fields and name not in self.page_sets]

    def _differs_from_stored(self, name: str, raw: Any) -> bool:
        form: Any = self
        field = form.fields[name]
        return field.has_changed(form.get_initial_for_field(field, name), raw)

    def clean(self) -> Any:
        cleaned = super().clean()  # type: ignore[misc]  # a mixin: ModelForm's
        form: Any = self
        if form.instance.pk is None:
            return cleaned
        for name in self._columns():
            field, bound = form.fields[name], form[name]
            if field.disabled or not field.show_hidden_initial or bound.html_initial_name not in form.data:
                continue  # a client that sends no page's value claims none: the value is judged as sent
            seen = field.hidden_widget().value_from_datadict(form.data, form.files, bound.html_initial_name)
            if self._differs_from_stored(name, seen) and self._differs_from_stored(name, bound.data):
                stored = form.get_initial_for_field(field, name)
                form.add_error(name, f"Changed by someone else since you opened this page: it is {worded(stored)} "
                                     "now. Nothing was saved; reload the page, and make your change again if it "
                                     "still holds.")
        return cleaned

    def changed_columns(self) -> list[str]:
        """The columns the operator changed from the page's value to one the row does not hold (changed_data
        compares with the page's value: show_hidden_initial)."""
        form: Any = self
        return [name for name in self._columns() if name in form.changed_data
                and not form.fields[name].disabled and self._differs_from_stored(name, form[name].data)]


class OwnChangesAdmin(PageSetsAdmin):
    """A ModelAdmin whose form is an OwnChangesForm: a change writes only the columns the operator changed (and the
    model's auto_now times with them), nothing when none; adding saves as usual."""

    def save_model(self, request: Any, obj: Any, form: Any, change: bool) -> None:
        if not change:
            super().save_model(request, obj, form, change)  # type: ignore[misc]  # a mixin: ModelAdmin's
            return
        columns = form.changed_columns()
        if columns:
            obj.save(update_fields=[*columns, *(f.name for f in obj._meta.concrete_fields
                                                if getattr(f, "auto_now", False) and f.name not in columns)])
