"""A manual top-up whose request died while Stripe charged the card (a web worker killed at its timeout raises
SystemExit, no StripeError) stayed `pending` for good (found by review): no follow-up looked at a manual pending
top-up, so with the webhook lost the card was charged and the wallet never credited. Now one still pending past
BILLING_TOP_UP_RECONCILE_AFTER_S is taken as having lost its answer and looked up at Stripe (top_ups_find_lost)."""
from datetime import timedelta

import pytest
from django.utils import timezone
from stripe._payment_intent_service import PaymentIntentService

from billing.models import Card, TopUp, TopUpStatus
from billing.services import reconcile
from billing.services.top_ups import top_up_create
from tests.billing.helpers import balance
from tests.billing.test_payments import save_card

pytestmark = pytest.mark.django_db

LATER = timedelta(seconds=901)  # well past BILLING_TOP_UP_RECONCILE_AFTER_S


def _killed_at(monkeypatch, *, after_stripe: bool) -> None:
    real_create = PaymentIntentService.create

    def killed(self, *args, **kwargs):
        if after_stripe:
            real_create(self, *args, **kwargs)  # Stripe charges the card ...
        raise SystemExit(1)  # ... and the request is killed before its answer is recorded

    monkeypatch.setattr(PaymentIntentService, "create", killed)


@pytest.mark.parametrize("charged", [True, False])
def test_a_manual_top_up_left_pending_by_a_killed_request_is_looked_up_and_settled(localstripe, api, monkeypatch,
                                                                                     charged):
    card = Card.objects.get(pk=save_card(api)["id"])
    _killed_at(monkeypatch, after_stripe=charged)
    with pytest.raises(SystemExit):
        top_up_create(user=api.user, amount_micros=25_000_000, card=card, idempotency_key="k1",
                      request_fingerprint="f")
    monkeypatch.undo()
    top_up = TopUp.objects.get()
    assert top_up.status == TopUpStatus.PENDING and not top_up.automatic

    assert reconcile.top_ups_find_lost(now=timezone.now()) == {}  # too soon: its request may still be running
    assert TopUp.objects.get().status == TopUpStatus.PENDING
    found = reconcile.top_ups_find_lost(now=timezone.now() + LATER)  # the webhook was lost too
    top_up.refresh_from_db()
    if charged:
        assert found == {"succeeded": 1} and top_up.status == TopUpStatus.SUCCEEDED
        assert balance(api.user) == 25_000_000
    else:
        assert found == {"not_charged": 1} and top_up.status == TopUpStatus.FAILED
        assert "never received the charge" in top_up.failure_message and balance(api.user) == 0
    assert not top_up.outcome_unknown
