"""Forms of the account and renting pages: they parse what people type and render it back, with the API's rules.
The provider's forms are in node_forms.py, the billing pages' in billing_forms.py.

No rule is written here: limits, validators and parsers come from where the API's serializers take them
(marketplace.validators, core.validators, core.money, the services' constants), so a page and the API accept and
refuse the same input (tests/web/test_same_rules.py); the services decide everything else.
"""

import json

from django import forms
from django.contrib.auth import password_validation
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError

from core import untrusted_json
from core.api.scopes import ALL_SCOPES, SCOPE_LABELS
from core.errors import ValidationFailed
from core.idempotency import WEB_REQUEST_TOKEN_MAX_LENGTH
from core.money import USD_MAX_DIGITS, USD_PLACES, micros_to_usd, usd_to_micros
from core.validators import no_control_characters
from marketplace.auth import ThrottledLoginFormMixin
from marketplace.mig import profiles_for
from marketplace.models import Image, SshKey, User
from marketplace.money import usd_rate_text
from marketplace.reauth import LockoutMixin, PasswordConfirmedForm
from marketplace.services import accounts as account_svc
from marketplace.services import instances as instance_svc
from marketplace.services import ssh_keys as ssh_svc
from marketplace.validators import (
    EMAIL_MAX_LENGTH,
    NAME_MAX_LENGTH,
    PASSWORD_MAX_LENGTH,
    SIGNUP_TOKEN_MAX_LENGTH,
    validate_instance_keys,
)

from .fields import TextareaField
from .rent_options import RentOptionsMixin
from .rent_volumes import RentVolumesMixin


class LoginForm(ThrottledLoginFormMixin, AuthenticationForm):
    username = forms.EmailField(label="Email", widget=forms.EmailInput(attrs={"autofocus": True,
                                                                          "autocomplete": "email"}))

    def clean_username(self):
        return self.cleaned_data["username"].lower()

    # An absurdly long password is a wrong one, unhashed and uncounted: the backend's bound (marketplace.auth).


class SignupForm(forms.Form):
    email = forms.EmailField(max_length=EMAIL_MAX_LENGTH, widget=forms.EmailInput(attrs={"autocomplete": "email"}))
    password = forms.CharField(
        max_length=PASSWORD_MAX_LENGTH, strip=False, widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text="At least 10 characters; not a common password, not all digits, not like your email.",
    )

    def clean_email(self):
        # Whether the address has an account is not said here (only in the e-mail the address gets). The limit is
        # checked on the address as it will be kept (lower case can be longer than what was typed).
        try:
            return account_svc.email_normalize(self.cleaned_data["email"])
        except ValidationFailed as exc:
            raise ValidationError(exc.message) from None

    def clean(self):
        cleaned = super().clean()
        if "email" in cleaned and "password" in cleaned:
            try:
                password_validation.validate_password(cleaned["password"], User(email=cleaned["email"]))
            except forms.ValidationError as exc:
                self.add_error("password", exc)
        return cleaned


def _refuse_private_key(form: forms.Form, name: str, value: str) -> None:
    """A pasted private key, of any format the service tells apart (a PuTTY .ppk too: before, one was shown back in
    the box, found by review r53), is refused and wiped from the form: a page never shows a secret back. The
    service's message says how to export the public key from it."""
    if ssh_svc.looks_like_private_key(value) or value.lstrip().startswith("-----BEGIN"):
        data = form.data.copy()  # type: ignore[attr-defined]  # a QueryDict (or a test's dict): both copy
        data[form.add_prefix(name)] = ""
        form.data = data
        try:
            ssh_svc.parse_public_key(value)
        except ssh_svc.PrivateKeyPasted as exc:
            raise ValidationError(str(exc)) from None
        except ssh_svc.InvalidSshKey:
            pass
        raise ValidationError("This is a private key: never share it. Paste the public key, the contents of the "
                              ".pub file. If this private key was typed anywhere else, make a new pair.")


def _parse_key(value: str) -> str:
    """The normalised `<type> <base64>` of one public key, or a ValidationError saying what is wrong."""
    try:
        return ssh_svc.parse_public_key(value).public_key
    except ssh_svc.InvalidSshKey as exc:
        raise ValidationError(str(exc)) from None


class SshKeyForm(PasswordConfirmedForm):
    """A saved key goes on every instance rented later: a session alone (a copied cookie) must not add one."""

    why_asked = "Your account's password: a saved key opens every instance you rent later."

    name = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters],
                           help_text="Optional; the key's comment is used when empty.")
    public_key = TextareaField(
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
    """The link's token and the password chosen at that sign-up: an address may get the e-mail of someone else's
    sign-up with it too, whose link must not make the owner an account with that person's password."""

    token = forms.CharField(max_length=SIGNUP_TOKEN_MAX_LENGTH, widget=forms.HiddenInput)
    password = forms.CharField(
        max_length=PASSWORD_MAX_LENGTH, strip=False,
        widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}),
        help_text="The password you chose when you signed up.")


class ApiKeyForm(PasswordConfirmedForm):
    """A key outlives the session and a password change: a session alone (a copied cookie) must not make one, so
    the password is asked, as POST /api/v1/auth/login/ does."""

    why_asked = "Your account's password: a key works until it is revoked, even after the password changes."

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


def unit_price_map(node) -> dict[str, int]:
    """What one unit of each choice costs per hour as the page shows it ("" = a whole GPU, else a MIG profile's
    slice, of `node.mig_free`), in micro-dollars."""
    return {"": int(node.price_per_gpu_hour_micros),
            **{profile: int(price) for profile, _, price in getattr(node, "mig_free", None) or []}}


def shown_disk_price_text(node) -> str:
    """The disk's price per GB-month as the rent page's hidden `shown_disk_price` carries it: a USD decimal."""
    return str(micros_to_usd(int(node.disk_price_per_gb_month_micros)))


def shown_prices_text(node) -> str:
    """unit_price_map as the rent page's hidden `shown_prices` carries it: JSON of USD decimals by choice."""
    return json.dumps({choice: str(micros_to_usd(micros)) for choice, micros in unit_price_map(node).items()},
                      separators=(",", ":"))


# A profile posted that the form does not offer now: never booked as whole GPUs in its place.
_PROFILE_GONE = ("MIG %(value)s slices are not one of the available choices now: none is free on this server (taken "
                 "since the page was shown), or it no longer rents them. Nothing was booked; choose again.")

_SHOWN_PRICE = forms.DecimalField(min_value=0, max_digits=USD_MAX_DIGITS, decimal_places=USD_PLACES)


class RentForm(LockoutMixin, RentOptionsMixin, RentVolumesMixin, forms.Form):
    image = _ImageChoices(queryset=Image.objects.none(), to_field_name="slug", empty_label=None,
                          widget=forms.RadioSelect)
    num_gpus = forms.IntegerField(label="Number of GPUs", min_value=1, initial=1)
    ssh_keys = _KeyChoices(label="Your SSH keys", queryset=SshKey.objects.none(), required=False,
                           widget=forms.CheckboxSelectMultiple)
    ssh_public_key = TextareaField(
        label="Or paste a public key", required=False, max_length=ssh_svc.MAX_KEY_CHARS, strip=False,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false", "autocomplete": "off",
                                     "placeholder": "ssh-ed25519 AAAA... you@laptop"}),
        help_text="One OpenSSH public key (the .pub file). It is put on this instance only, unless you save it.",
    )
    save_key = forms.BooleanField(label="Also save this key to my SSH keys", required=False)
    save_key_password = forms.CharField(
        label="Your password, to save the key", required=False, strip=False,  # a check: no maximum (reauth.py)
        widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}),
        help_text="Only when you save the key: a saved key opens every instance you rent later.")
    disk_gb = forms.IntegerField(label="Disk (GB)", required=False, min_value=1, max_value=instance_svc.MAX_DISK_GB,
                                 help_text="Leave empty for the image's minimum.")
    label = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters],
                            help_text="Optional: a name to find it by.")
    # Makes a double submission (a double click, a resent form) book once: the page's own token.
    request_token = forms.CharField(widget=forms.HiddenInput, required=False,
                                    max_length=WEB_REQUEST_TOKEN_MAX_LENGTH)
    # The price per unit-hour of each choice as the page showed it (shown_prices_text): the most the renter agreed
    # to, which the booking checks under the node's lock (a raise since is a 409 and the page asks again). Altered,
    # it can only lower what its sender accepts, so it is not signed; left out (a page from before it), no check.
    shown_prices = forms.CharField(label="Prices shown", widget=forms.HiddenInput, required=False, max_length=4000)
    # The disk's price per GB-month as the page showed it (the host's facts): a stopped instance's disk is billed
    # at it, so a raise since is refused as the GPU's is (booking's max_disk_price_micros). Before, only the GPU and
    # slice prices were held to the page, and a disk raised to $10/GB-month booked silently (found by review).
    shown_disk_price = forms.CharField(label="Disk price shown", widget=forms.HiddenInput, required=False,
                                       max_length=40)

    def __init__(self, *args, user, node, request=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.user, self.request = user, request
        images = Image.objects.filter(active=True).order_by("name")
        runnable = [image.pk for image in images if image.supports(node.runtime)]
        self.fields["image"].queryset = images.filter(pk__in=runnable)
        self.fields["image"].help_text = "Everything runs on " + node.get_runtime_display().lower() + "."
        free = getattr(node, "num_gpus_free", node.gpu_count)
        self.fields["num_gpus"] = forms.IntegerField(
            label="Number of GPUs", min_value=1, max_value=node.gpu_count, initial=1,
            help_text=f"{free} of this server's {node.gpu_count} GPUs are free now.")
        self._add_mig_choice(node, free)
        if "mig_profile" not in self.fields and self.is_bound and self.data.get(self.add_prefix("mig_profile")):
            self._refuse_gone_profile()
        self.fields["ssh_keys"].queryset = keys = SshKey.objects.filter(user=user).order_by("-created_at", "-id")
        self.setup_volumes(user=user, node=node)
        self.limit_options(node=node)
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
        choices = [("", f"Whole GPUs: {usd_rate_text(node.price_per_gpu_hour_micros)} per GPU-hour, "
                        f"{free_gpus} free")] if free_gpus else []
        choices += [(profile, f"MIG {profile} slices ({memory.get(profile, '?')} GB each): {usd_rate_text(price)} per "
                              f"slice-hour, {n} free") for profile, n, price in slices]
        self.fields["mig_profile"] = forms.ChoiceField(
            label="What to rent", choices=choices, required=not free_gpus, widget=forms.RadioSelect,
            initial=choices[0][0], error_messages={"invalid_choice": _PROFILE_GONE},
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

    def _refuse_gone_profile(self) -> None:
        """A posted MIG profile where the node has no free slice now (they were taken since the page was shown, or
        the provider cleared the layout; or the field was made up): the choice, refused. Left out, Django dropped
        the unknown field and the form booked as many whole GPUs, at the whole GPU's price (found by review)."""
        self.fields["mig_profile"] = forms.ChoiceField(
            label="What to rent", choices=[("", "Whole GPUs")], required=False, widget=forms.HiddenInput,
            error_messages={"invalid_choice": _PROFILE_GONE})
        self.mig_choices = {"": "Whole GPUs"}

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

    def clean_shown_prices(self) -> dict[str, int]:
        """{choice: micro-dollars} of the posted prices ({} when none was posted); a form error when unreadable."""
        text = self.cleaned_data["shown_prices"]
        if not text:
            return {}
        unreadable = ValidationError("The prices this page showed could not be read: reload the page, check the "
                                     "price and book again.")
        try:
            shown = untrusted_json.loads(text)  # deep nesting is a ValueError here, not a RecursionError
        except ValueError:
            raise unreadable from None
        if not isinstance(shown, dict) or not all(isinstance(v, str) for v in shown.values()):
            raise unreadable
        try:
            return {choice: usd_to_micros(_SHOWN_PRICE.clean(value)) for choice, value in shown.items()}
        except ValidationError:
            raise unreadable from None

    def clean_shown_disk_price(self) -> int | None:
        """The posted disk price per GB-month in micro-dollars (None when none was posted); a form error when
        unreadable."""
        text = self.cleaned_data["shown_disk_price"]
        if not text:
            return None
        try:
            return usd_to_micros(_SHOWN_PRICE.clean(text))
        except ValidationError:
            raise ValidationError("The disk price this page showed could not be read: reload the page, check the "
                                  "price and book again.") from None

    def max_disk_price_micros(self) -> int | None:
        """The most the renter agreed to pay per GB-month of disk (booking's max_disk_price_micros), or None where
        the page sent none."""
        return self.cleaned_data.get("shown_disk_price")

    def max_price_micros(self) -> int | None:
        """The most the renter agreed to pay per unit-hour of what they chose (booking's max_price_micros), or None
        where the page sent no price for it."""
        shown = self.cleaned_data.get("shown_prices") or {}
        return shown.get(self.cleaned_data.get("mig_profile") or "")

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
        if cleaned.get("save_key") and cleaned.get("ssh_public_key"):
            self._confirm_save_key(cleaned.get("save_key_password") or "")
        self.clean_options()
        return cleaned

    def _confirm_save_key(self, password: str) -> None:
        """Saving the pasted key needs the password, as the SSH keys page does (a copied cookie must not add a key
        to every later instance); checked before anything is booked, behind the log-in lock-out."""
        if not password:
            self.add_error("save_key_password", "Type your password to save this key, or untick “Also save this "
                                                "key”: a saved key opens every instance you rent later.")
            return
        try:
            self._check_password(self.user, password, self.request)
        except ValidationError as exc:
            self.add_error("save_key_password", exc)

    def public_keys(self) -> list[str]:
        keys = [k.public_key for k in self.cleaned_data.get("ssh_keys", [])]
        if self.cleaned_data.get("ssh_public_key"):
            keys.append(_parse_key(self.cleaned_data["ssh_public_key"]))
        return keys
