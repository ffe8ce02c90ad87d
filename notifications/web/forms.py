from dataclasses import dataclass

from django import forms

from core.idempotency import WEB_REQUEST_TOKEN_MAX_LENGTH
from core.validators import no_control_characters
from marketplace.reauth import PasswordConfirmedForm
from notifications.models import EMAIL_ONLY_KINDS
from notifications.selectors import KindChannels
from notifications.services.notify import PREFERENCE_CHANNELS
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


CHANNEL_HEADINGS = {"in_app": "In the list", "email": "E-mail", "webhook": "Webhooks"}


@dataclass(frozen=True)
class ChannelCell:
    heading: str
    field: forms.BoundField | None  # None: a channel the kind is never told on (EMAIL_ONLY_KINDS)


@dataclass(frozen=True)
class ChannelRow:
    label: str
    cells: list[ChannelCell]


class ChannelsForm(forms.Form):
    """The channels grid: a checkbox per kind and channel (`<kind>:<channel>`), each carrying the value the page
    showed (show_hidden_initial), so that `changes_since_shown` is what its user changed since the page was opened.
    Saving compared the posted boxes with the stored choices instead, and undid a choice made meanwhile (the API,
    another tab), and a kind the page did not show (added by a deploy since) was turned off on every channel, an
    absent checkbox counting as off (found by review)."""

    def __init__(self, *args, preferences: list[KindChannels], **kwargs):
        kwargs.setdefault("auto_id", False)  # the boxes are named by their aria-label, and "kind:channel" is no id
        super().__init__(*args, **kwargs)
        self.rows: list[ChannelRow] = []
        for preference in preferences:
            cells = []
            for channel in PREFERENCE_CHANNELS:
                if preference.kind in EMAIL_ONLY_KINDS and channel != "email":
                    cells.append(ChannelCell(CHANNEL_HEADINGS[channel], None))
                    continue
                name = f"{preference.kind}:{channel}"
                self.fields[name] = forms.BooleanField(
                    required=False, show_hidden_initial=True, initial=getattr(preference, channel),
                    widget=forms.CheckboxInput(
                        attrs={"aria-label": f"{preference.label}: {CHANNEL_HEADINGS[channel].lower()}"}))
                cells.append(ChannelCell(CHANNEL_HEADINGS[channel], self[name]))
            self.rows.append(ChannelRow(preference.label, cells))

    def changes_since_shown(self) -> dict[str, dict[str, bool]]:
        """{kind: {channel: posted value}} of the boxes whose posted value differs from the one the page showed (its
        hidden initial value). A box the page did not show (no hidden initial value: a kind added since it was
        opened, or a page from before these values) is left as it is: an absent checkbox is off only next to the
        value it was shown with."""
        changes: dict[str, dict[str, bool]] = {}
        for name, field in self.fields.items():
            bound = self[name]
            if bound.html_initial_name not in self.data:
                continue
            shown = field.to_python(field.hidden_widget().value_from_datadict(
                self.data, self.files, bound.html_initial_name))
            posted = field.clean(bound.data)
            if shown != posted:
                kind, channel = name.split(":")
                changes.setdefault(kind, {})[channel] = posted
        return changes

    def shown_any(self) -> bool:
        """Whether the post carries any value the page showed: one without (a page from before them) saves nothing."""
        return any(self[name].html_initial_name in self.data for name in self.fields)
