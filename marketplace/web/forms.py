"""Forms of the web pages: they parse what people type and render it back, with the API's rules.

No rule is written here: limits, validators and parsers come from where the API's serializers take them
(marketplace.validators, core.validators, core.money, the services' constants), so a page and the API accept and
refuse the same input (tests/web/test_same_rules.py); the services decide everything else.
"""
import re

from django import forms
from django.conf import settings
from django.contrib.auth import password_validation
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django_countries import countries

from billing.selectors import cards_for_user
from billing.services.cards import SETUP_INTENT_ID
from billing.services.profiles import CONNECT_ACCOUNT_ID, CONNECT_ACCOUNT_MESSAGE
from core.api.scopes import ALL_SCOPES, SCOPE_LABELS
from core.money import CENTS_MAX_DIGITS, CENTS_PLACES, USD_MAX_DIGITS, USD_PLACES, parse_cents
from core.validators import no_control_characters
from marketplace.auth import ThrottledLoginFormMixin
from marketplace.mig import profiles_for
from marketplace.models import GpuModel, Image, Runtime, SshKey, User
from marketplace.money import usd_text
from marketplace.services import instances as instance_svc
from marketplace.services import ssh_keys as ssh_svc
from marketplace.validators import (
    ADDRESS_MAX_LENGTH,
    EMAIL_MAX_LENGTH,
    FINGERPRINT_MAX_LENGTH,
    MAX_GPUS_PER_NODE,
    NAME_MAX_LENGTH,
    PASSWORD_MAX_LENGTH,
    PRICE_LIMITS,
    SIGNUP_TOKEN_MAX_LENGTH,
    SSH_PORT_MAX,
    SSH_PORT_MIN,
    SSH_USER_MAX_LENGTH,
    validate_address,
    validate_host_key_fingerprint,
    validate_instance_keys,
    validate_ssh_user,
)

from .rent_options import RentOptionsMixin
from .rent_volumes import RentVolumesMixin


class LoginForm(ThrottledLoginFormMixin, AuthenticationForm):
    username = forms.EmailField(label="Email", widget=forms.EmailInput(attrs={"autofocus": True,
                                                                          "autocomplete": "email"}))

    def clean_username(self):
        return self.cleaned_data["username"].lower()


class SignupForm(forms.Form):
    email = forms.EmailField(max_length=EMAIL_MAX_LENGTH, widget=forms.EmailInput(attrs={"autocomplete": "email"}))
    password = forms.CharField(
        max_length=PASSWORD_MAX_LENGTH, strip=False, widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text="At least 10 characters; not a common password, not all digits, not like your email.",
    )

    def clean_email(self):
        # Whether the address has an account is not said here (only in the e-mail the address gets).
        return self.cleaned_data["email"].lower()

    def clean(self):
        cleaned = super().clean()
        if "email" in cleaned and "password" in cleaned:
            try:
                password_validation.validate_password(cleaned["password"], User(email=cleaned["email"]))
            except forms.ValidationError as exc:
                self.add_error("password", exc)
        return cleaned


def _refuse_private_key(form: forms.Form, name: str, value: str) -> None:
    """A pasted private key is refused and wiped from the form: a page never shows a secret back."""
    if "PRIVATE KEY" in value or value.lstrip().startswith("-----BEGIN"):
        data = form.data.copy()  # type: ignore[attr-defined]  # a QueryDict (or a test's dict): both copy
        data[form.add_prefix(name)] = ""
        form.data = data
        raise ValidationError("This is a private key: never share it. Paste the public key, the contents of the "
                              ".pub file. If this private key was typed anywhere else, make a new pair.")


def _parse_key(value: str) -> str:
    """The normalised `<type> <base64>` of one public key, or a ValidationError saying what is wrong."""
    try:
        return ssh_svc.parse_public_key(value).public_key
    except ssh_svc.InvalidSshKey as exc:
        raise ValidationError(str(exc)) from None


class SshKeyForm(forms.Form):
    name = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters],
                           help_text="Optional; the key's comment is used when empty.")
    public_key = forms.CharField(
        label="Public key", max_length=ssh_svc.MAX_KEY_CHARS, strip=False,
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false", "autocomplete": "off",
                                     "placeholder": "ssh-ed25519 AAAA... you@laptop"}),
        help_text="One OpenSSH public key, e.g. the contents of ~/.ssh/id_ed25519.pub. Never paste a private key.",
    )

    def clean_public_key(self):
        value = self.cleaned_data["public_key"]
        _refuse_private_key(self, "public_key", value)
        _parse_key(value)
        return value


class SignupConfirmForm(forms.Form):
    token = forms.CharField(max_length=SIGNUP_TOKEN_MAX_LENGTH, widget=forms.HiddenInput)


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters],
                           help_text="Something to tell your keys apart, e.g. “laptop” or “CI”.")
    scopes = forms.MultipleChoiceField(
        choices=[(s, f"{s}: {SCOPE_LABELS[s]}") for s in ALL_SCOPES], initial=list(ALL_SCOPES),
        widget=forms.CheckboxSelectMultiple, label="What the key may do",
        error_messages={"required": "Choose at least one scope."},
        help_text="A request outside the key's scopes is refused (403) and the answer names the scope it needs.")
    expires_in_days = forms.TypedChoiceField(
        label="Expires", coerce=int, initial=0,
        choices=[(0, "never"), (7, "in 7 days"), (30, "in 30 days"), (90, "in 90 days"), (365, "in a year")],
        help_text="After this the key is refused (401, saying it expired).")


class _KeyChoices(forms.ModelMultipleChoiceField):
    def label_from_instance(self, key):
        return f"{key.name or 'unnamed'} ({key.fingerprint})"


class _ImageChoices(forms.ModelChoiceField):
    def label_from_instance(self, image):
        return image.name


class RentForm(RentOptionsMixin, RentVolumesMixin, forms.Form):
    image = _ImageChoices(queryset=Image.objects.none(), to_field_name="slug", empty_label=None,
                          widget=forms.RadioSelect)
    num_gpus = forms.IntegerField(label="Number of GPUs", min_value=1, initial=1)
    ssh_keys = _KeyChoices(label="Your SSH keys", queryset=SshKey.objects.none(), required=False,
                           widget=forms.CheckboxSelectMultiple)
    ssh_public_key = forms.CharField(
        label="Or paste a public key", required=False, max_length=ssh_svc.MAX_KEY_CHARS, strip=False,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false", "autocomplete": "off",
                                     "placeholder": "ssh-ed25519 AAAA... you@laptop"}),
        help_text="One OpenSSH public key (the .pub file). It is put on this instance only, unless you save it.",
    )
    save_key = forms.BooleanField(label="Also save this key to my SSH keys", required=False)
    disk_gb = forms.IntegerField(label="Disk (GB)", required=False, min_value=1, max_value=instance_svc.MAX_DISK_GB,
                                 help_text="Leave empty for the image's minimum.")
    label = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters],
                            help_text="Optional: a name to find it by.")
    # Makes a double submission (a double click, a resent form) book once: the page's own token.
    request_token = forms.CharField(widget=forms.HiddenInput, required=False, max_length=100)

    def __init__(self, *args, user, node, **kwargs):
        super().__init__(*args, **kwargs)
        images = Image.objects.filter(active=True).order_by("name")
        runnable = [image.pk for image in images if image.supports(node.runtime)]
        self.fields["image"].queryset = images.filter(pk__in=runnable)
        self.fields["image"].help_text = "Everything runs on " + node.get_runtime_display().lower() + "."
        free = getattr(node, "num_gpus_free", node.gpu_count)
        self.fields["num_gpus"] = forms.IntegerField(
            label="Number of GPUs", min_value=1, max_value=node.gpu_count, initial=1,
            help_text=f"{free} of this server's {node.gpu_count} GPUs are free now.")
        self._add_mig_choice(node, free)
        self.fields["ssh_keys"].queryset = keys = SshKey.objects.filter(user=user).order_by("-created_at", "-id")
        self.setup_volumes(user=user, node=node)
        if not self.is_bound:
            saved = list(keys.values_list("pk", flat=True)[:2])
            if not saved:
                self.fields["ssh_keys"].help_text = "You have no saved keys yet: paste one below."
            elif len(saved) == 1:  # the only key: ticked, so that "Rent now" works at once
                self.initial.setdefault("ssh_keys", saved)

    def _add_mig_choice(self, node, free_gpus: int) -> None:
        """With free MIG slices (`node.mig_free`: [(profile, free, price micros)], as the offers page reads them),
        the renter chooses whole GPUs or one profile's slices; only what is free now is offered. The booking
        service decides the rest (a profile the node does not rent, more slices than are free: 400 naming it)."""
        slices = getattr(node, "mig_free", None) or []
        if not slices:
            return
        memory = {name: p.memory_gb for name, p in profiles_for(node.gpu_model.slug).items()}
        choices = [("", f"Whole GPUs: {usd_text(node.price_per_gpu_hour_micros)} per GPU-hour, "
                        f"{free_gpus} free")] if free_gpus else []
        choices += [(profile, f"MIG {profile} slices ({memory.get(profile, '?')} GB each): {usd_text(price)} per "
                              f"slice-hour, {n} free") for profile, n, price in slices]
        self.fields["mig_profile"] = forms.ChoiceField(
            label="What to rent", choices=choices, required=not free_gpus, widget=forms.RadioSelect,
            initial=choices[0][0],
            help_text="A MIG slice is an isolated part of one GPU, with its own memory and compute; your instance "
                      "sees only its slices.")
        self.mig_choices = dict(choices)
        if self.initial.get("mig_profile") not in self.mig_choices:  # e.g. a link's profile no longer free
            self.initial.pop("mig_profile", None)
        # Slices are counted by the same field; the service says how many of the chosen profile are free.
        most = max(node.gpu_count, *(n for _, n, _ in slices))
        self.fields["num_gpus"] = forms.IntegerField(
            label="Number of GPUs or slices", min_value=1, max_value=most, initial=1,
            help_text=f"{free_gpus} of this server's {node.gpu_count} GPUs are free now, and "
                      + ", ".join(f"{n} {profile} slice{'s' if n != 1 else ''}" for profile, n, _ in slices) + ".")

    def unit_price_micros(self, node) -> int:
        """The price per hour of one GPU, or one slice of the chosen profile (for the estimate)."""
        profile = self.chosen_profile()
        for name, _, price in getattr(node, "mig_free", None) or []:
            if name == profile:
                return int(price)
        return int(node.price_per_gpu_hour_micros)

    def chosen_profile(self) -> str:
        """The MIG profile chosen (or shown first), "" for whole GPUs; one of the offered choices only."""
        if "mig_profile" not in self.fields:
            return ""
        value = self["mig_profile"].value() or ""
        return value if value in self.mig_choices else ""

    def clean_ssh_keys(self):
        keys = self.cleaned_data["ssh_keys"]
        validate_instance_keys(keys)
        return keys

    def clean_ssh_public_key(self):
        value = self.cleaned_data["ssh_public_key"]
        if not value.strip():
            return ""
        _refuse_private_key(self, "ssh_public_key", value)
        _parse_key(value)
        return value

    def clean(self):
        cleaned = super().clean()
        if not cleaned.get("ssh_keys") and not cleaned.get("ssh_public_key") and "ssh_public_key" not in self.errors:
            self.add_error("ssh_keys", "Choose at least one of your keys, or paste a public key.")
        self.clean_options()
        return cleaned

    def public_keys(self) -> list[str]:
        keys = [k.public_key for k in self.cleaned_data.get("ssh_keys", [])]
        if self.cleaned_data.get("ssh_public_key"):
            keys.append(_parse_key(self.cleaned_data["ssh_public_key"]))
        return keys


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
                              help_text="Hostname or IP address the platform connects to over SSH.")
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

    def clean_address(self):
        return self.cleaned_data["address"].lower()


class NodeSettingsForm(forms.Form):
    price_per_gpu_hour = PriceField(help_text="New rentals pay it; running instances keep their price.")
    listed = forms.BooleanField(required=False, label="Listed: renters can book it",
                                help_text="Untick to take it off the offers; running instances are not touched.")
    maintenance = forms.BooleanField(required=False, label="In maintenance",
                                     help_text="No new rentals and no scheduled checks until you switch it off.")


_LAYOUT_LINE = re.compile(r"\s*GPU\s*(\d+)\s*:\s*(.*)", re.IGNORECASE)
_PRICE_LINE = re.compile(r"\s*(\S+)\s*:\s*\$?\s*(\S+)\s*")


class _LinesField(forms.CharField):
    """A textarea of lines; its max_length applies to the text typed (the parsed value is a list or a dict)."""

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
    (marketplace.services.nodes._check_mig), answered on the field they concern."""

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


# --------------------------------------------------------------------------------------------- billing

class _CardChoices(forms.ModelChoiceField):
    def label_from_instance(self, card):
        expiry = f", expires {card.exp_month:02d}/{card.exp_year}" if card.exp_month and card.exp_year else ""
        return f"{(card.brand or 'card').title()} •••• {card.last4 or '????'}{expiry}"


class CentsField(forms.DecimalField):
    """USD in whole cents, parsed as the API's CentsField parses it (core.money.parse_cents): "25." is refused."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_digits", CENTS_MAX_DIGITS)
        kwargs.setdefault("decimal_places", CENTS_PLACES)
        super().__init__(**kwargs)

    # Only which message a refused amount gets: a plain number is told its bounds or places ("-5", "25.001").
    _NUMBER = re.compile(r"\s*-?\d+(\.\d+)?\s*")

    def to_python(self, value):
        number = super().to_python(value)
        if isinstance(value, str) and value.strip():
            try:
                parse_cents(value)
            except ValueError:
                if self._NUMBER.fullmatch(value):
                    self.validate(number)
                    self.run_validators(number)
                raise ValidationError(self.error_messages["invalid"], code="invalid") from None
        return number


class TopUpForm(forms.Form):
    """Add money with a saved card. The bounds are the API's (BILLING_TOP_UP_MIN_USD/MAX_USD, whole cents)."""

    amount = CentsField(label="Amount (USD)", widget=forms.NumberInput(attrs={"step": "0.01", "inputmode": "decimal"}))
    card = _CardChoices(label="Card", queryset=None, empty_label=None, widget=forms.RadioSelect)
    # Makes a double submission (a double click, a resent form) charge once: the page's own token.
    request_token = forms.CharField(widget=forms.HiddenInput, required=False, max_length=100)

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        low, high = settings.BILLING_TOP_UP_MIN_USD, settings.BILLING_TOP_UP_MAX_USD
        amount = self.fields["amount"]
        amount.min_value, amount.max_value = low, high
        amount.validators += [MinValueValidator(low), MaxValueValidator(high)]
        amount.widget.attrs.update(min=str(low), max=str(high))
        amount.help_text = f"Between ${low:,} and ${high:,}, in whole cents."
        self.fields["card"].queryset = cards_for_user(user=user)
        if not self.is_bound:
            self.fields["card"].initial = self.fields["card"].queryset.values_list("pk", flat=True).first()


# Stripe's test payment methods, for localstripe and Stripe's test mode (never shown with a live key).
TEST_CARDS = [
    ("pm_card_visa", "Visa 4242 — test card, payments succeed"),
    ("pm_card_mastercard", "Mastercard 4444 — test card, payments succeed"),
    ("pm_card_chargeCustomerFail", "Visa 0341 — test card, saved, but payments are declined"),
]


class TestCardForm(forms.Form):
    payment_method = forms.ChoiceField(label="Test card", choices=TEST_CARDS, widget=forms.RadioSelect,
                                       initial="pm_card_visa")


class ElementsCardForm(forms.Form):
    """What Stripe Elements sends after the browser confirmed a SetupIntent with the card."""

    setup_intent = forms.RegexField(regex=SETUP_INTENT_ID, max_length=100, widget=forms.HiddenInput)


class UsageFilterForm(forms.Form):
    instance: forms.ModelChoiceField = forms.ModelChoiceField(queryset=None, required=False,
                                                              empty_label="All instances")

    def __init__(self, *args, instances, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["instance"].queryset = instances
        self.fields["instance"].label_from_instance = (
            lambda i: f"#{i.pk}{' · ' + i.label if i.label else ''} ({i.num_gpus} × {i.gpu_model.name})")


class PayoutAccountForm(forms.Form):
    stripe_connect_account_id = forms.RegexField(
        label="Stripe Connect account", regex=CONNECT_ACCOUNT_ID, max_length=100, required=False,
        error_messages={"invalid": CONNECT_ACCOUNT_MESSAGE},
        help_text="Where your weekly payouts go (acct_...). Leave empty to stop payouts.")
