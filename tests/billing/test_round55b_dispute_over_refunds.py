"""A dispute over a charge that was already partly refunded (review r55 LOW-2).

Stripe withdraws the whole disputed amount whatever was refunded, so the wallet is debited in full (the ledger
follows Stripe's cash: a $100 top-up refunded $60 and then disputed for $100 leaves the wallet at -$60). Such a
dispute is usually won by answering it with the refund. Before, the renter's notice said only "debited" (a second
debit of money already refunded, with no word of the refund), and nothing told operators to answer it.
"""
import logging

import pytest
from django.test import Client
from django.urls import reverse

from billing.models import BillingEvent, Dispute, LedgerTransaction
from billing.services.disputes import CHARGEBACK_NOTE
from tests.billing.helpers import balance
from tests.billing.test_disputes import (
    PROCESSED,
    USD_100,
    answer,
    credited_top_up,
    dispute_event,
    refund_obj,
    refunded_event,
)
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator():
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


def _changelist(operator, **query) -> str:
    page = operator.get(reverse("admin:billing_dispute_changelist"), query)
    assert page.status_code == 200
    return page.content.decode()


def test_a_dispute_over_a_refunded_charge_is_debited_in_full_and_says_so_to_the_renter_and_operators(
        anon, user, operator, caplog):
    credited_top_up(user)
    assert answer(anon, refunded_event("evt_r", [refund_obj(amount=6_000)])) == PROCESSED  # $60 refunded at Stripe
    with caplog.at_level(logging.WARNING, logger="billing.services.disputes"):
        assert answer(anon, dispute_event("evt_d", amount=10_000)) == PROCESSED  # $100 disputed
    assert balance(user) == -60_000_000  # as Stripe's cash: kept

    [event] = BillingEvent.objects.filter(user=user, kind="chargeback")
    assert "$60.00 of this top-up had already been refunded to your card" in event.message, event.message
    assert event.data["refunded"] == "60.000000"
    [txn] = LedgerTransaction.objects.filter(kind="chargeback")
    assert txn.customer_note != CHARGEBACK_NOTE and "already been refunded" in txn.customer_note  # the statement
    assert "Dispute over a refunded charge" in txn.reason and "refund as evidence" in txn.reason
    assert any("dp_1" in r.getMessage() and "already refunded" in r.getMessage() for r in caplog.records)

    assert "over a refunded charge: $60.000000 of the $100.000000 top-up" in _changelist(operator)
    assert "dp_1" in _changelist(operator, over_refunds="yes")
    detail = operator.get(reverse("admin:billing_dispute_change", args=[Dispute.objects.get().pk]))
    assert detail.status_code == 200 and b"usually won" in detail.content


@pytest.mark.parametrize(("refunded_cents", "disputed_cents"), [(0, 10_000), (2_000, 8_000)],
                         ids=["none-refunded", "the-unrefunded-rest"])
def test_a_dispute_within_what_was_left_unrefunded_is_told_as_before(
        anon, user, operator, refunded_cents, disputed_cents):
    credited_top_up(user)
    if refunded_cents:
        assert answer(anon, refunded_event("evt_r", [refund_obj(amount=refunded_cents)])) == PROCESSED
    assert answer(anon, dispute_event("evt_d", amount=disputed_cents)) == PROCESSED
    assert balance(user) == USD_100 - (refunded_cents + disputed_cents) * 10_000 == 0
    [event] = BillingEvent.objects.filter(user=user, kind="chargeback")
    assert "refunded" not in event.message and "refunded" not in event.data
    [txn] = LedgerTransaction.objects.filter(kind="chargeback")
    assert txn.customer_note == CHARGEBACK_NOTE and "refunded charge" not in txn.reason
    assert "top-up was refunded" not in _changelist(operator)
    assert "dp_1" not in _changelist(operator, over_refunds="yes")
