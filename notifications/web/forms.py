from django import forms

from core.idempotency import WEB_REQUEST_TOKEN_MAX_LENGTH
from core.validators import no_control_characters
from marketplace.reauth import PasswordConfirmedForm
from notifications.services.urls import URL_MAX_LENGTH
from notifications.services.webhooks import DESCRIPTION_MAX_LENGTH


class EndpointForm(PasswordConfirmedForm):
    """An endpoint receives the account's events until it is deleted: a session alone (a copied cookie) must not
    add one."""

    why_asked = "Your account's password: the endpoint receives your account's events until you delete it."

    url = forms.CharField(label="URL", max_length=URL_MAX_LENGTH, validators=[no_control_characters],
                          widget=forms.URLInput(attrs={"placeholder": "https://example.com/hooks/gpumarket",
                                                       "autocomplete": "off"}),
                          help_text="https:// to a public address. Each event is a JSON POST signed with the "
                                    "endpoint's secret.")
    description = forms.CharField(max_length=DESCRIPTION_MAX_LENGTH, required=False,
                                  validators=[no_control_characters])
    # The page's own token: the form submitted twice (a double click) adds one endpoint and shows its secret again.
    request_token = forms.CharField(widget=forms.HiddenInput, required=False, max_length=WEB_REQUEST_TOKEN_MAX_LENGTH)
