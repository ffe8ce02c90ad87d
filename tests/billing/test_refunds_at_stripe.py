"""Every refund follows one rule, whoever made it (an operator through the platform, or someone in Stripe's
dashboard): the wallet is debited while Stripe has it pending, requires_action or succeeded, and given back once
when it fails or is canceled, however often and in whatever order Stripe's events about it arrive.

Before, a refund made in Stripe's dashboard was debited by `charge.refunded` from the charge's refunded total and
never given back when it failed (its `refund.updated`/`charge.refund.updated`/`refund.failed` found no refund of
the platform's and was ignored): the renter lost money the card never got (found by review). Events are posted
signed, as Stripe sends them (localstripe emits no charge or refund events)."""
import time

import pytest
import stripe as stripe_sdk
from django.core import mail

from billing.models import BillingEvent, LedgerTransaction, Refund, StripeEvent
from billing.services.refunds import refund_confirm
from tests.billing.helpers import balance
from tests.billing.test_disputes import (
    IGNORED,
    PROCESSED,
    USD_100,
    answer,
    credited_top_up,
    refund_obj,
    refunded_event,
    stripe_paid_top_up,
)
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def refund_event(event_id: str, kind: str = "refund.updated", **refund) -> dict:
    """An event whose object is the Refund (refund.created/.updated/.failed, charge.refund.updated)."""
    return {"id": event_id, "object": "event", "type": kind, "created": int(time.time()),
            "data": {"object": refund_obj(**refund)}}


charge_refunded = refunded_event  # the charge with its refunds listed


def reversals() -> list[LedgerTransaction]:
    return list(LedgerTransaction.objects.filter(kind="reversal").order_by("pk"))


@pytest.mark.parametrize(("kind", "status"), [
    ("refund.updated", "failed"), ("refund.updated", "canceled"), ("refund.failed", "failed"),
    ("charge.refund.updated", "failed"),
])
def test_a_refund_made_in_stripes_dashboard_that_fails_later_is_given_back_once(
        anon, user, kind, status, django_capture_on_commit_callbacks):
    top_up = credited_top_up(user)
    assert answer(anon, charge_refunded("evt_1", [refund_obj(status="pending")])) == PROCESSED
    assert balance(user) == USD_100 - 25_000_000
    with django_capture_on_commit_callbacks(execute=True):
        assert answer(anon, refund_event("evt_2", kind=kind, status=status,
                                         failure_reason="expired_or_canceled_card")) == PROCESSED
    assert balance(user) == USD_100
    # Replayed, and told again by the other events (and by the charge's list, which shows it failed): nothing more.
    assert answer(anon, refund_event("evt_2", kind=kind, status=status)) == PROCESSED
    assert answer(anon, refund_event("evt_3", kind="charge.refund.updated", status=status)) == PROCESSED
    assert answer(anon, charge_refunded("evt_4", [refund_obj(status=status)])) == PROCESSED
    assert balance(user) == USD_100
    refund = Refund.objects.get(stripe_refund_id="re_dash")
    assert (refund.status, refund.origin, refund.created_by, refund.top_up_id) == ("failed", "stripe", None, top_up.pk)
    [back] = reversals()
    assert back.reverses == refund.transaction and back.idempotency_key == f"refund-failed:{refund.pk}"
    assert back.customer_note  # the renter's statement says what it is
    told = BillingEvent.objects.filter(user=user, kind="refund", data__failed=True)
    assert told.count() == 1 and "$25.00 is back in your balance" in told.get().message
    assert any(user.email in m.to and "$25.00" in m.body for m in mail.outbox)


@pytest.mark.parametrize("status", ["pending", "requires_action", "succeeded"])
def test_a_refund_made_in_stripes_dashboard_told_by_its_refund_events_alone_is_debited_once(
        anon, user, client_for, status):
    """Stripe's API since 2024 sends refund.created / refund.updated for every refund; an endpoint may send those
    and not charge.refunded. Before, refund.created was not handled and refund.updated acted on failures only."""
    credited_top_up(user)
    assert answer(anon, refund_event("evt_c", kind="refund.created", status=status)) == PROCESSED
    assert balance(user) == USD_100 - 25_000_000
    assert answer(anon, refund_event("evt_u", status="succeeded")) == PROCESSED
    assert answer(anon, charge_refunded("evt_r", [refund_obj()])) == PROCESSED
    assert balance(user) == USD_100 - 25_000_000
    refund = Refund.objects.get(stripe_refund_id="re_dash")
    assert refund.status == "succeeded" and refund.transaction.idempotency_key == "refund:re_dash"
    [shown] = client_for(user).get("/api/v1/billing/top-ups/").json()["results"]
    assert shown["refunded"] == "25.000000"


def test_a_failure_told_before_the_refund_itself_debits_nothing_ever(anon, user):
    credited_top_up(user)
    assert answer(anon, refund_event("evt_f", kind="refund.failed", status="failed")) == PROCESSED
    assert answer(anon, refund_event("evt_c", kind="refund.created", status="pending")) == PROCESSED  # late
    assert answer(anon, charge_refunded("evt_r", [refund_obj(status="succeeded")])) == PROCESSED  # late, stale
    assert answer(anon, refund_event("evt_u", status="succeeded")) == PROCESSED  # late, stale
    assert balance(user) == USD_100
    refund = Refund.objects.get(stripe_refund_id="re_dash")
    assert refund.status == "failed" and refund.transaction is None and not reversals()


def test_two_dashboard_refunds_of_one_charge_are_each_debited_and_given_back_on_their_own(anon, user):
    credited_top_up(user)
    first, second = refund_obj("re_a", 1_000), refund_obj("re_b", 3_000, status="pending")
    assert answer(anon, charge_refunded("evt_1", [first])) == PROCESSED
    assert answer(anon, charge_refunded("evt_2", [second, first])) == PROCESSED
    assert balance(user) == USD_100 - 40_000_000
    assert answer(anon, refund_event("evt_3", refund_id="re_b", amount=3_000, status="canceled")) == PROCESSED
    assert balance(user) == USD_100 - 10_000_000
    assert answer(anon, charge_refunded("evt_0", [first])) == PROCESSED  # an older list, delivered late
    assert balance(user) == USD_100 - 10_000_000


def test_a_late_charge_refunded_of_a_platform_refund_that_failed_debits_nothing_again(anon, user):
    """The platform's refund, debited, then failed at Stripe (given back); the charge.refunded Stripe sent when it
    was made arrives after that. Before, it was read as a dashboard refund of the amount and debited again."""
    top_up = credited_top_up(user)
    made = Refund.objects.create(top_up=top_up, amount_micros=15_000_000, reason="asked",
                                 created_by=UserFactory(is_staff=True))
    refund_confirm(refund_id=made.pk, stripe_refund_id="re_ours")
    ours = refund_obj("re_ours", 1_500, metadata={"refund_id": str(made.pk)})
    assert answer(anon, refund_event("evt_f", kind="refund.failed", **{**ours, "status": "failed"})) == PROCESSED
    assert balance(user) == USD_100
    assert answer(anon, charge_refunded("evt_late", [ours])) == PROCESSED
    assert balance(user) == USD_100
    assert Refund.objects.get().status == "failed"


def test_a_platform_refund_whose_answer_was_lost_is_debited_by_its_refund_event(anon, user):
    """One rule for the platform's refunds too: Stripe's refund.created (or charge.refunded) settles a refund still
    pending here as the follow-up would (debited once), and a later failure gives it back."""
    top_up = credited_top_up(user)
    pending = Refund.objects.create(top_up=top_up, amount_micros=15_000_000, reason="asked",
                                    created_by=UserFactory(is_staff=True))
    ours = refund_obj("re_lost", 1_500, status="pending", metadata={"refund_id": str(pending.pk)})
    assert answer(anon, refund_event("evt_c", kind="refund.created", **ours)) == PROCESSED
    pending.refresh_from_db()
    assert pending.status == "succeeded" and pending.stripe_refund_id == "re_lost"
    assert balance(user) == USD_100 - 15_000_000
    refund_confirm(refund_id=pending.pk, stripe_refund_id="re_lost")  # the create's answer, late: nothing more
    assert answer(anon, charge_refunded("evt_r", [ours])) == PROCESSED
    assert balance(user) == USD_100 - 15_000_000
    assert Refund.objects.count() == 1


@pytest.mark.parametrize(("refund", "reason"), [
    ({"currency": "eur"}, "not in usd"),
    ({"amount": "2500"}, "not a whole number of cents"),
    ({"amount": 0}, "not an amount of top-up"),
    ({"amount": 10_001}, "not an amount of top-up"),
    ({"status": "weird"}, "status"),
    ({"intent": "pi_not_ours"}, "paid no top-up here"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_refund_at_stripe_that_cannot_be_read_or_is_not_ours_is_ignored_with_the_reason(anon, user, refund, reason):
    credited_top_up(user)
    assert answer(anon, refund_event("evt_m", kind="refund.created", **refund)) == IGNORED
    assert reason in StripeEvent.objects.get(event_id="evt_m").error
    assert balance(user) == USD_100 and not Refund.objects.exists()


def test_charge_refunded_without_its_refunds_listed_asks_stripe_for_them(localstripe, api):
    """Stripe's API since 2022-11-15 leaves a charge's refunds out of charge.refunded: they are listed at Stripe
    (outside the event's transaction), each applied by the one rule."""
    from tests.billing.test_payments import _credited_top_up, stripe_client

    top_up = _credited_top_up(localstripe, api)  # $40
    stripe = stripe_client(localstripe)
    made = stripe.refunds.create(params={"payment_intent": top_up.payment_intent_id, "amount": 1_000})  # "dashboard"
    charge = stripe.charges.retrieve(made.charge).to_dict()
    charge.pop("refunds", None)
    event = {"id": "evt_cr", "object": "event", "type": "charge.refunded", "created": int(time.time()),
             "data": {"object": charge}}
    assert answer(api, event) == PROCESSED
    assert answer(api, {**event, "id": "evt_cr2"}) == PROCESSED
    assert balance(api.user) == 30_000_000
    failed = {**made.to_dict(), "status": "failed"}
    assert answer(api, {"id": "evt_fail", "object": "event", "type": "refund.updated", "created": int(time.time()),
                        "data": {"object": failed}}) == PROCESSED
    assert balance(api.user) == 40_000_000


def test_charge_refunded_without_its_refunds_while_stripe_is_away_fails_and_applies_when_delivered_again(
        localstripe, anon, user, settings):
    top_up, charge_id = stripe_paid_top_up(localstripe, user)
    stripe = stripe_sdk.StripeClient("sk_test_x", base_addresses={"api": localstripe.url}, max_network_retries=0).v1
    stripe.refunds.create(params={"payment_intent": top_up.payment_intent_id, "amount": 2_000})
    charge = {"id": charge_id, "object": "charge", "amount": 10_000, "amount_refunded": 2_000, "currency": "usd",
              "payment_intent": top_up.payment_intent_id, "refunded": False}
    event = {"id": "evt_away", "object": "event", "type": "charge.refunded", "created": int(time.time()),
             "data": {"object": charge}}
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"
    assert answer(anon, event)["code"] == 500
    assert StripeEvent.objects.get(event_id="evt_away").status == "failed" and balance(user) == USD_100
    settings.STRIPE_API_BASE = localstripe.url
    assert answer(anon, event) == PROCESSED
    assert balance(user) == USD_100 - 20_000_000
    assert Refund.objects.get().origin == "stripe"


def test_a_refund_naming_only_its_charge_is_matched_by_it(localstripe, anon, user):
    """Refund objects of API versions before 2019 name only the charge: matched as a dispute naming only its charge
    is (the charge recorded with the top-up, else asked of Stripe)."""
    _, charge_id = stripe_paid_top_up(localstripe, user)
    made = refund_event("evt_c", kind="refund.created", intent=None, charge=charge_id, status="pending")
    assert answer(anon, made) == PROCESSED
    assert balance(user) == USD_100 - 25_000_000
    failed = refund_event("evt_f", kind="charge.refund.updated", intent=None, charge=charge_id, status="failed")
    assert answer(anon, failed) == PROCESSED
    assert balance(user) == USD_100


def test_a_platform_refund_stripe_answered_failed_is_not_debited_by_a_late_event(localstripe, api, monkeypatch):
    """What Stripe's own answers say failed (the create's answer, the follow-up's lookup) is kept with the refund's
    Stripe id: a stale event saying it was pending, delivered afterwards, finds it failed and debits nothing."""
    from types import SimpleNamespace

    from billing.services import reconcile, refunds
    from core.errors import Conflict
    from tests.billing.test_payments import _credited_top_up

    top_up = _credited_top_up(localstripe, api)  # $40
    operator = UserFactory(is_staff=True)
    monkeypatch.setattr(refunds, "client", lambda: SimpleNamespace(v1=SimpleNamespace(refunds=SimpleNamespace(
        create=lambda params, options: SimpleNamespace(id="re_answered_failed", status="failed")))))
    with pytest.raises(Conflict):
        refunds.refund_create(top_up=top_up, amount_micros=10_000_000, reason="asked", created_by=operator)
    answered = Refund.objects.get()

    looked_up = Refund.objects.create(top_up=top_up, amount_micros=5_000_000, reason="asked", created_by=operator)
    made = SimpleNamespace(id="re_looked_up_failed", status="canceled",
                           to_dict=lambda: {"metadata": {"refund_id": str(looked_up.pk)}})
    monkeypatch.setattr(reconcile, "client", lambda: SimpleNamespace(v1=SimpleNamespace(refunds=SimpleNamespace(
        list=lambda params: SimpleNamespace(auto_paging_iter=lambda: iter([made]))))))
    assert reconcile.refund_reconcile(refund_id=looked_up.pk) == "failed"

    for refund, stripe_id, amount in ((answered, "re_answered_failed", 1_000), (looked_up, "re_looked_up_failed", 500)):
        late = refund_event(f"evt_late_{refund.pk}", kind="refund.created", refund_id=stripe_id,
                            amount=amount, intent=top_up.payment_intent_id, status="pending",
                            metadata={"refund_id": str(refund.pk)})
        assert answer(api, late) == PROCESSED
        refund.refresh_from_db()
        assert refund.status == "failed" and refund.transaction is None
    assert balance(api.user) == 40_000_000 and Refund.objects.count() == 2


def test_a_refund_its_event_debited_while_the_create_answer_travelled_is_given_back_when_that_answer_says_failed(
        localstripe, api, monkeypatch):
    """Stripe's refund event can settle an operator's refund before the create's answer is recorded (the one rule
    debits it); an answer then saying it failed must give that debit back, not mark it failed and keep the money."""
    from types import SimpleNamespace

    from billing.services import refunds
    from core.errors import Conflict
    from tests.billing.test_payments import _credited_top_up

    top_up = _credited_top_up(localstripe, api)  # $40

    def create(params, options):
        told = refund_obj("re_raced", 1_500, status="pending", intent=top_up.payment_intent_id,
                          metadata={"refund_id": params["metadata"]["refund_id"]})
        assert answer(api, refund_event("evt_raced", kind="refund.created", **told)) == PROCESSED
        assert balance(api.user) == 25_000_000
        return SimpleNamespace(id="re_raced", status="failed")

    monkeypatch.setattr(refunds, "client", lambda: SimpleNamespace(v1=SimpleNamespace(
        refunds=SimpleNamespace(create=create))))
    with pytest.raises(Conflict, match="refund failed"):
        refunds.refund_create(top_up=top_up, amount_micros=15_000_000, reason="asked",
                              created_by=UserFactory(is_staff=True))
    refund = Refund.objects.get()
    assert refund.status == "failed" and balance(api.user) == 40_000_000
    assert LedgerTransaction.objects.filter(idempotency_key=f"refund-failed:{refund.pk}").count() == 1


def test_the_renters_statement_lists_a_dashboard_refund_and_the_failures_give_back_in_its_words(anon, user,
                                                                                                 client_for):
    """The statement's refunds total counted a dashboard refund its lines left out (it had no Refund row); a failed
    refund's give-back said nothing to the renter (no customer note)."""
    from django.utils import timezone

    from billing.services.refunds import REFUND_FAILED_NOTE

    credited_top_up(user)
    assert answer(anon, charge_refunded("evt_1", [refund_obj(status="pending")])) == PROCESSED
    assert answer(anon, refund_event("evt_2", kind="refund.failed", status="failed")) == PROCESSED
    statement = client_for(user).get(f"/api/v1/billing/statements/{timezone.now():%Y-%m}/").json()
    assert statement["refunds"] == "25.000000"
    assert [(line["amount"], line["note"]) for line in statement["refund_lines"]] == [
        ("25.000000", "Refunded to your card.")]
    assert [(line["amount"], line["note"]) for line in statement["adjustment_lines"]] == [
        ("25.000000", REFUND_FAILED_NOTE)]
    assert statement["closing_balance"] == "100.000000"
