from django import forms

from core.validators import no_control_characters
from notifications.services.urls import URL_MAX_LENGTH
from notifications.services.webhooks import DESCRIPTION_MAX_LENGTH


class EndpointForm(forms.Form):
    url = forms.CharField(label="URL", max_length=URL_MAX_LENGTH, validators=[no_control_characters],
                          widget=forms.URLInput(attrs={"placeholder": "https://example.com/hooks/gpumarket",
                                                       "autocomplete": "off"}),
                          help_text="https:// to a public address. Each event is a JSON POST signed with the "
                                    "endpoint's secret.")
    description = forms.CharField(max_length=DESCRIPTION_MAX_LENGTH, required=False,
                                  validators=[no_control_characters])
