"""Forms of the billing pages: top-ups with a saved card, adding a card, the usage filter, the payout account.

As in forms.py, no rule is written here: amounts parse as the API parses them (core.money.parse_cents), the bounds
are the API's settings, the ids' patterns are the billing services' (tests/web/test_same_rules.py).
"""
import re

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator

from billing.selectors import cards_for_user
from billing.services.cards import SETUP_INTENT_ID
from billing.services.profiles import CONNECT_ACCOUNT_ID, CONNECT_ACCOUNT_MESSAGE
from core.idempotency import WEB_REQUEST_TOKEN_MAX_LENGTH
from core.money import CENTS_MAX_DIGITS, CENTS_PLACES, parse_cents
from marketplace.reauth import PasswordConfirmedForm


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
    request_token = forms.CharField(widget=forms.HiddenInput, required=False,
                                    max_length=WEB_REQUEST_TOKEN_MAX_LENGTH)

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


class PayoutAccountForm(PasswordConfirmedForm):
    """Where the earnings go: a session alone (a copied cookie) must not redirect them, so the password is asked,
    and the change is e-mailed (billing.services.profiles)."""

    why_asked = "Your account's password, to change where your earnings go."

    stripe_connect_account_id = forms.RegexField(
        label="Stripe Connect account", regex=CONNECT_ACCOUNT_ID, max_length=100, required=False,
        error_messages={"invalid": CONNECT_ACCOUNT_MESSAGE},
        help_text="Where your weekly payouts go (acct_...). Leave empty to stop payouts.")

