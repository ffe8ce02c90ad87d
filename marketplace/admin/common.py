"""What the operators' pages of the marketplace share."""
from typing import Any


class NothingEditableAdmin:
    """A ModelAdmin whose change page has no editable field of its model (its changes are its actions, which call
    the services): its Save writes nothing. Django's wrote the whole row back as the page had read it, over what a
    booking, a check, a worker or the owner had changed meanwhile (an instance's status, a key revoked by its owner;
    found by review). Adding, where a page allows it, saves as usual."""

    def save_model(self, request: Any, obj: Any, form: Any, change: bool) -> None:
        if not change:
            super().save_model(request, obj, form, change)  # type: ignore[misc]  # a mixin: ModelAdmin supplies it
