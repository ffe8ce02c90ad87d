"""Amounts typed in cents take ASCII digits only (review r53 #3): core.money's rule used \\d without re.ASCII, so
"٥" (Arabic-Indic 5), "１０" (fullwidth 10) and mixes like "1٥" passed the top-up, refund and profile amounts (a
TopUp recorded and its charge tried; a profile PATCH stored $5), which the published schema's pattern refuses.
Spaces around an amount stay ignored, as parse_cents documents."""
import pytest

from billing.models import BillingProfile, Card, TopUp
from core.money import parse_cents

NON_ASCII = ["٥", "１０", "1٥", "٥.٠٠", "25.٥", "२५"]


@pytest.mark.parametrize("text", NON_ASCII)
def test_parse_cents_refuses_non_ascii_digits(text):
    with pytest.raises(ValueError):
        parse_cents(text)


def test_parse_cents_still_takes_ascii_amounts_and_ignores_spaces_around_them():
    assert parse_cents("25") == 2500 and parse_cents("25.5") == 2550 and parse_cents(" 25.00 ") == 2500


@pytest.mark.django_db
@pytest.mark.parametrize("text", NON_ASCII)
def test_a_top_up_in_non_ascii_digits_is_a_400_and_nothing_is_recorded(api, text):
    card = Card.objects.create(user=api.user, stripe_payment_method_id="pm_ascii_1")
    response = api.post("/api/v1/billing/top-ups/", {"amount": text, "card": card.pk}, format="json")
    assert response.status_code == 400 and "amount" in response.json(), response.content
    assert not TopUp.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("field", ["auto_top_up_threshold", "auto_top_up_amount"])
def test_profile_amounts_in_non_ascii_digits_are_a_400_and_nothing_is_stored(api, field):
    for text in ("٥", "１０"):
        response = api.patch("/api/v1/billing/profile/", {field: text}, format="json")
        assert response.status_code == 400 and field in response.json(), (text, response.content)
    profile = BillingProfile.objects.filter(user=api.user).first()
    assert profile is None or (profile.auto_top_up_threshold_micros, profile.auto_top_up_amount_micros) == (
        BillingProfile().auto_top_up_threshold_micros, BillingProfile().auto_top_up_amount_micros)


@pytest.mark.django_db
def test_a_refund_amount_in_non_ascii_digits_is_a_400(refund_operator_api):
    response = refund_operator_api.post("/api/v1/billing/refunds/", {"top_up": 1, "amount": "１０", "reason": "x"},
                                        format="json")
    assert response.status_code == 400 and "amount" in response.json(), response.content
