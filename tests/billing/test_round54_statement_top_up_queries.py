"""Review r54 (earn #2): the statement API ran one query per top-up line (each line's `refunded` read its refunds),
unseen by tests/test_query_counts.py because tests/api_contract/world made top-ups without a ledger credit, so a
statement had no top-up lines. statement_for prefetches the refunds; world credits its top-ups."""
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from billing.models import Card, Refund, TopUp
from billing.services.top_ups import top_up_credit
from tests.api_contract import world
from tests.factories import UserFactory, api_key_for

pytestmark = pytest.mark.django_db


def _credited_top_ups(user, n: int) -> None:
    card = Card.objects.create(user=user, stripe_payment_method_id=f"pm_r54q_{user.pk}", brand="visa", last4="4242",
                               exp_month=12, exp_year=2040)
    for _ in range(n):
        top_up = TopUp.objects.create(user=user, amount_micros=5_000_000, card=card, card_label=str(card))
        with transaction.atomic():
            top_up_credit(top_up_id=top_up.pk, payment_intent_id=f"pi_r54q_{top_up.pk}", amount_micros=5_000_000)
        Refund.objects.create(top_up=top_up, amount_micros=1_000_000, reason="r54", created_by=user)


def _statement_queries(user, month: str) -> tuple[int, dict]:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(user)}")
    client.get(f"/api/v1/billing/statements/{month}/")  # a key's first use writes
    with CaptureQueriesContext(connection) as captured:
        response = client.get(f"/api/v1/billing/statements/{month}/")
    assert response.status_code == 200
    return len(captured.captured_queries), response.json()


def test_the_statement_queries_do_not_grow_with_its_top_up_lines(clock):
    month = f"{clock.now:%Y-%m}"
    few, many = UserFactory(), UserFactory()
    _credited_top_ups(few, 2)
    _credited_top_ups(many, 12)
    n_few, _ = _statement_queries(few, month)
    n_many, body = _statement_queries(many, month)
    assert len(body["top_up_lines"]) == 12
    assert {line["refunded"] for line in body["top_up_lines"]} == {"0.000000"}  # asked for, not made: not refunded
    assert n_many == n_few, (n_few, n_many)


def test_the_contract_worlds_top_ups_are_statement_lines(clock):
    user = UserFactory()
    made = world.top_up(user)
    assert made.transaction_id is not None
    _, body = _statement_queries(user, f"{clock.now:%Y-%m}")
    assert [line["id"] for line in body["top_up_lines"]] == [made.pk]
