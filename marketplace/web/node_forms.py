"""Forms of the provider's pages: registering a node, its price and listing, its MIG layout and slice prices.

As in forms.py, no rule is written here: limits and validators are the API's (marketplace.validators,
core.validators), and the MIG rules are the service's (tests/web/test_same_rules.py).
"""
import re

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError
from django_countries import countries

from core.money import USD_MAX_DIGITS, USD_PLACES
from core.validators import no_control_characters
from marketplace.models import GpuModel, Runtime
from marketplace.validators import (
    ADDRESS_MAX_LENGTH,
    FINGERPRINT_MAX_LENGTH,
    MAX_GPUS_PER_NODE,
    NAME_MAX_LENGTH,
    PRICE_LIMITS,
    SSH_PORT_MAX,
    SSH_PORT_MIN,
    SSH_USER_MAX_LENGTH,
    canonical_address,
    validate_address,
    validate_host_key_fingerprint,
    validate_ssh_user,
)

from .fields import TextareaField


class _ModelChoices(forms.ModelChoiceField):
    def label_from_instance(self, model):
        return f"{model.name} ({model.memory_gb} GB)"


COUNTRY_CHOICES = [("", "Choose a country")] + [(code, name) for code, name in countries]


class PriceField(forms.DecimalField):
    """USD per GPU-hour, with the API's digits, places and bounds (core.api.fields.UsdField, PRICE_LIMITS)."""

    def __init__(self, **kwargs):
        super().__init__(label="Price per GPU-hour (USD)", max_digits=USD_MAX_DIGITS, decimal_places=USD_PLACES,
                         **PRICE_LIMITS, **kwargs)


class NodeRegisterForm(forms.Form):
    name = forms.CharField(max_length=NAME_MAX_LENGTH, validators=[no_control_characters],
                           help_text="Your name for the server, e.g. rack1-a6000.")
    address = forms.CharField(max_length=ADDRESS_MAX_LENGTH, validators=[validate_address],
                              help_text="The server's public IP address, or a name that resolves to it: the platform "
                                        "connects there over SSH.")
    ssh_port = forms.IntegerField(label="SSH port", min_value=SSH_PORT_MIN, max_value=SSH_PORT_MAX, initial=22)
    ssh_user = forms.CharField(label="SSH user", max_length=SSH_USER_MAX_LENGTH, validators=[validate_ssh_user],
                               help_text="The user the platform logs in as; it needs sudo for the runtime.")
    host_key_fingerprint = forms.CharField(
        label="Host key fingerprint", max_length=FINGERPRINT_MAX_LENGTH, required=False,
        validators=[validate_host_key_fingerprint],
        help_text="SHA256:... from `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the server. "
                  "Without it, the key seen on first contact is pinned.",
    )
    country = forms.ChoiceField(choices=COUNTRY_CHOICES)
    city = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters])
    datacenter = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters])
    gpu_model = _ModelChoices(label="GPU model", queryset=GpuModel.objects.all(), to_field_name="slug",
                              empty_label="Choose the model of its GPUs")
    gpu_count = forms.IntegerField(label="Number of GPUs", min_value=1, max_value=MAX_GPUS_PER_NODE)
    price_per_gpu_hour = PriceField(help_text="What a renter pays per GPU per hour.")
    runtime = forms.ChoiceField(choices=Runtime.choices, initial=Runtime.DOCKER, widget=forms.RadioSelect)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not settings.SIM_NODES_ALLOWED:  # simulated GPUs: tests and demos only (services.nodes.SIM_REFUSED)
            self.fields["runtime"].choices = [c for c in Runtime.choices if c[0] != Runtime.SIM]

    def clean_address(self):
        return canonical_address(self.cleaned_data["address"])  # as the API stores it


class NodeSettingsForm(forms.Form):
    """Each field carries the value the page showed (show_hidden_initial), so that changed_since_shown is what its
    user changed since the page was opened: the view saves only that, and an unlisting (or a price) set meanwhile
    by an operator or through the API is not undone by a save of the other fields (found by review)."""

    price_per_gpu_hour = PriceField(help_text="New rentals pay it; running instances keep their price.",
                                    show_hidden_initial=True)
    listed = forms.BooleanField(required=False, label="Listed: renters can book it", show_hidden_initial=True,
                                help_text="Untick to take it off the offers; running instances are not touched.")
    maintenance = forms.BooleanField(required=False, label="In maintenance", show_hidden_initial=True,
                                     help_text="No new rentals and no scheduled checks until you switch it off.")
    # The endpoint: proven on the server before it is stored (provisioning.services.endpoint_change).
    # Not required: a post without them (an older page, a script) leaves them as they are (the view drops blanks).
    address = forms.CharField(max_length=ADDRESS_MAX_LENGTH, validators=[validate_address], show_hidden_initial=True,
                              required=False,
                              help_text="The server's public IP address, or a name that resolves only to public "
                                        "addresses. When it changes (the server was renumbered or moved), the "
                                        "platform logs in there first and takes it only if the server presents this "
                                        "node's pinned SSH host key and accepts its key.")
    ssh_port = forms.IntegerField(label="SSH port", min_value=SSH_PORT_MIN, max_value=SSH_PORT_MAX, required=False,
                                  show_hidden_initial=True)
    ssh_user = forms.CharField(label="SSH user", max_length=SSH_USER_MAX_LENGTH, validators=[validate_ssh_user],
                               required=False, show_hidden_initial=True, help_text="The user the platform logs in as.")
    # Only until the node's first contact (node_update's rule): kept in the form only then (host_key_editable).
    host_key_fingerprint = forms.CharField(
        label="Host key fingerprint", max_length=FINGERPRINT_MAX_LENGTH, required=False, show_hidden_initial=True,
        validators=[validate_host_key_fingerprint],
        help_text="SHA256:... from `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the server. Empty, the key "
                  "seen on first contact is pinned. It can be corrected until the platform first reaches the server.",
    )

    def __init__(self, *args, host_key_editable: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if not host_key_editable:
            del self.fields["host_key_fingerprint"]

    def clean_address(self):
        value = self.cleaned_data["address"]
        return canonical_address(value) if value else value  # as the API stores it

    def changed_since_shown(self) -> list[str]:
        """The fields whose value differs from what the page showed (its hidden initial values), or, for a post
        without them, from the node's current values (the form's initial)."""
        changed = []
        for name, field in self.fields.items():
            bound = self[name]
            if bound.html_initial_name not in self.data:
                shown = bound.initial
            else:
                try:  # cleaned, not only parsed: a price "sNaN" parses, and a signalling NaN raises when compared
                    shown = field.clean(field.hidden_widget().value_from_datadict(
                        self.data, self.files, bound.html_initial_name))
                except ValidationError:  # not a value the page could have shown: take the field as changed
                    changed.append(name)
                    continue
            if field.has_changed(shown, bound.data):
                changed.append(name)
        return changed


_LAYOUT_LINE = re.compile(r"\s*GPU\s*(\d+)\s*:\s*(.*)", re.IGNORECASE)
_PRICE_LINE = re.compile(r"\s*(\S+)\s*:\s*\$?\s*(\S+)\s*")


class _LinesField(TextareaField):
    """A textarea of lines; its max_length applies to the text typed, line breaks as LF (the parsed value is a
    list or a dict)."""

    def lines(self, value) -> list[str]:
        text = super().to_python(value) or ""
        if self.max_length is not None and len(text) > self.max_length:
            raise ValidationError(f"At most {self.max_length} characters.")
        return [raw for raw in text.splitlines() if raw.strip()]


class MigLayoutLinesField(_LinesField):
    """Lines "GPU <index>: <profile>, ..." as the API's mig_layout ([{"gpu": 0, "profiles": [...]}]); whether the
    profiles fit the model is the service's rule (marketplace.mig.layout_problems via node_update)."""

    def to_python(self, value):
        layout = []
        for n, line in enumerate(self.lines(value)):
            match = _LAYOUT_LINE.fullmatch(line)
            profiles = [p.strip() for p in match.group(2).split(",")] if match else []
            if not match or not all(profiles):
                raise ValidationError(f"Line {n + 1} must read “GPU <index>: <profile>, <profile>, ...”.")
            layout.append({"gpu": int(match.group(1)), "profiles": profiles})
        return layout


class MigPricesLinesField(_LinesField):
    """Lines "<profile>: <price>" as the API's mig_prices, each price by the API's price rule (PriceField); which
    profiles need one is the service's rule (marketplace.mig.price_problems)."""

    def to_python(self, value):
        prices, price_field = {}, PriceField()
        for n, line in enumerate(self.lines(value)):
            match = _PRICE_LINE.fullmatch(line)
            if not match:
                raise ValidationError(f"Line {n + 1} must read “<profile>: <price>”, e.g. “3g.40gb: 0.70”.")
            profile = match.group(1)
            if profile in prices:
                raise ValidationError(f"{profile} is given twice: one line per profile.")
            try:
                prices[profile] = price_field.clean(match.group(2))
            except ValidationError as exc:
                raise ValidationError(f"{profile}: {' '.join(exc.messages)}") from None
        return prices


class NodeMigForm(forms.Form):
    """A node's MIG layout and slice prices, typed as lines; parsed into the API's JSON shapes, whose rules
    (profiles of the model, no overfilled card, a price for each profile used and none other) are the service's
    (marketplace.services.nodes._check_mig), answered on the field they concern.

    Each field carries the text the page showed (show_hidden_initial), so that changed_since_shown is what its user
    changed since the page was opened, and the view saves only that: both were written as the page showed them, so
    a Save made for the prices wrote back the layout the page had shown over one declared meanwhile (through the
    API, or the page in another tab), and the reverse (found by review). As NodeSettingsForm."""

    mig_layout = MigLayoutLinesField(
        label="MIG layout", required=False, max_length=2000,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false", "autocomplete": "off",
                                     "placeholder": "GPU 0: 3g.40gb, 3g.40gb\nGPU 1: 1g.10gb, 1g.10gb, 2g.20gb"}),
        help_text="One line per split GPU: its index, then its profiles. GPUs not named stay whole. "
                  "Empty: no MIG. The next check holds it against nvidia-smi.")
    mig_prices = MigPricesLinesField(
        label="Prices per slice-hour (USD)", required=False, max_length=2000,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false", "autocomplete": "off",
                                     "placeholder": "3g.40gb: 0.70\n1g.10gb: 0.25"}),
        help_text="One line per profile of the layout: the profile, then its price.")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for field in self.fields.values():
            field.show_hidden_initial = True

    def changed_since_shown(self) -> list[str]:
        """The fields whose parsed value differs from what the page showed (its hidden initial text), or, for a
        post without it, from the node's current declaration (the form's initial); compared parsed, so a line
        break or a space more is no change."""
        changed = []
        for name, field in self.fields.items():
            bound = self[name]
            shown_text = (bound.initial if bound.html_initial_name not in self.data else
                          field.hidden_widget().value_from_datadict(self.data, self.files, bound.html_initial_name))
            try:
                shown = field.clean(shown_text)
            except ValidationError:  # not a value the page could have shown: take the field as changed
                changed.append(name)
                continue
            if field.has_changed(shown, bound.data):
                changed.append(name)
        return changed
