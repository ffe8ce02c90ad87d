"""Automatic top-ups and a deactivated account, or auto top-up turned off or changed (found by review, round 45).

After an operator deactivated an account (its owner can no longer log in nor use an API key), every meter tick still
started an automatic top-up and charged the saved card; storage stays billed after a deactivation, so the card was
charged again and again, and the owner could not stop it. And an automatic top-up is created `pending` and charged
later (the task queued on commit, or the per-minute follow-up when that task was lost): nothing read the profile
again, so one was charged after its owner had turned auto top-up off.

Now the tick starts none for an inactive account (nor does auto_top_up_start), and the charge reads the profile and
the account again under the profile's lock right before it goes out: auto top-up still on, with the same card and
amount, and the account active (read under its row's key-share lock, so a deactivation under way is waited for).
Otherwise the top-up ends as not charged: failed, its outcome known, nothing sent to Stripe."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction

from billing.models import BillingEvent, BillingProfile, Card, TopUp, TopUpStatus
from billing.services import reconcile
from billing.services.metering import usage_meter
from billing.services.top_ups import auto_top_up_start, top_up_charge_by_id
from billing.tasks import usage_meter_tick
from marketplace.models import User
from marketplace.services.account_status import account_deactivate
from tests.billing.helpers import balance, fund, node, running
from tests.billing.test_payments import save_card
from tests.factories import UserFactory


def _auto_top_up_on(api, card_id, *, amount="20.00"):
    r = api.patch("/api/v1/billing/profile/", {"auto_top_up_enabled": True, "auto_top_up_threshold": "5.00",
                                               "auto_top_up_amount": amount, "auto_top_up_card": card_id},
                  format="json")
    assert r.status_code == 200, r.content


@pytest.fixture
def no_stripe(monkeypatch):
    """Stripe as the charge would reach it, recorded: any customer or PaymentIntent asked for is a charge."""
    asked = []

    def customer_for(*, user):
        asked.append(("customer", user.pk))
        return "cus_test"

    def client():
        asked.append(("payment_intent", None))
        raise AssertionError("the card was charged")

    monkeypatch.setattr("billing.services.top_ups.customer_for", customer_for)
    monkeypatch.setattr("billing.services.top_ups.client", client)
    return asked


def _pending(user, *, amount_micros=20_000_000):
    card = Card.objects.create(user=user, stripe_payment_method_id=f"pm_local_{user.pk}")
    BillingProfile.objects.create(user=user, auto_top_up_enabled=True, auto_top_up_card=card,
                                  auto_top_up_threshold_micros=5_000_000, auto_top_up_amount_micros=amount_micros)
    fund(user, "1")
    top_up = auto_top_up_start(user_id=user.pk)
    assert top_up is not None and top_up.status == TopUpStatus.PENDING
    return top_up


def _not_charged(top_up, why):
    top_up.refresh_from_db()
    assert (top_up.status, top_up.outcome_unknown, top_up.payment_intent_id) == (TopUpStatus.FAILED, False, None)
    assert top_up.failure_message.startswith("Not charged") and why in top_up.failure_message, top_up.failure_message
    assert "card was not charged" in top_up.failure_message
    assert top_up.transaction_id is None


# ------------------------------------------------------------------------------------------ a deactivated account


@pytest.mark.django_db
def test_a_deactivated_accounts_card_is_not_charged_by_auto_top_up(clock, api, no_task_queue,
                                                                    django_capture_on_commit_callbacks):
    card = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_9")
    BillingProfile.objects.create(user=api.user, auto_top_up_enabled=True, auto_top_up_card=card,
                                  auto_top_up_threshold_micros=5_000_000, auto_top_up_amount_micros=20_000_000)
    fund(api.user, "6")
    running(api.user, node("3.600000"))
    clock.advance(1800)
    usage_meter()  # $1.80 of GPU time: the balance is $4.20, under the $5 threshold
    assert balance(api.user) == 4_200_000
    operator = UserFactory(is_staff=True)
    with django_capture_on_commit_callbacks(execute=True):
        account_deactivate(user=api.user, by=operator, reason="fraud suspected")
    api.user.refresh_from_db()
    assert not api.user.is_active
    no_task_queue.clear()
    clock.advance(60)
    with django_capture_on_commit_callbacks(execute=True):
        usage_meter_tick()
    # The owner can neither log in nor use a key to turn auto top-up off: the platform starts no charge of their card.
    assert list(TopUp.objects.filter(user=api.user).values_list("automatic", "amount_micros", "status")) == []
    assert [q for q in no_task_queue if q[0] == "top_up_charge"] == []
    # Called on its own too.
    assert auto_top_up_start(user_id=api.user.pk) is None
    assert not TopUp.objects.filter(user=api.user).exists()


@pytest.mark.django_db
def test_a_pending_automatic_top_up_of_an_account_deactivated_since_is_not_charged(clock, no_stripe, no_task_queue):
    owner = UserFactory()
    top_up = _pending(owner)
    User.objects.filter(pk=owner.pk).update(is_active=False)  # deactivated before its charge task ran
    top_up_charge_by_id(top_up_id=top_up.pk)
    assert no_stripe == []
    _not_charged(top_up, "deactivated")
    assert not BillingEvent.objects.filter(user=owner, kind="top_up_failed").exists()
    assert BillingProfile.objects.get(user=owner).auto_top_up_enabled is True  # its owner's setting, untouched
    # The follow-up finds nothing pending to charge, and a tick starts no other one.
    clock.advance(3600)
    assert reconcile.top_ups_charge_pending() == 0
    assert auto_top_up_start(user_id=owner.pk) is None
    assert no_stripe == []


@pytest.mark.django_db(transaction=True)
def test_a_deactivation_under_way_when_the_charge_rechecks_is_waited_for_and_the_card_not_charged(no_stripe):
    """The race: the operator's deactivation holds the account's row (not committed yet) while the charge task reads
    it. The re-check waits for it (the row's key-share lock) and sees the account off; read unlocked, it would read
    it still active and charge the card a moment before the deactivation committed."""
    owner, operator = UserFactory(), UserFactory(is_staff=True)
    top_up = _pending(owner)
    holding, go = threading.Event(), threading.Event()
    errors: dict[str, BaseException] = {}

    def deactivate():
        try:
            with transaction.atomic():
                account_deactivate(user=User.objects.get(pk=owner.pk), by=operator, reason="fraud suspected")
                holding.set()
                go.wait(10)
        except BaseException as exc:  # noqa: BLE001
            errors["deactivate"] = exc
        finally:
            connection.close()

    def charge():
        try:
            top_up_charge_by_id(top_up_id=top_up.pk)
        except BaseException as exc:  # noqa: BLE001
            errors["charge"] = exc
        finally:
            connection.close()

    d, c = threading.Thread(target=deactivate), threading.Thread(target=charge)
    try:
        d.start()
        assert holding.wait(10)
        c.start()
        watcher = connections.create_connection("default")
        waited = False
        try:
            deadline = time.monotonic() + 5
            with watcher.cursor() as cursor:
                while time.monotonic() < deadline and c.is_alive():  # the charge waits for the account's row
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                   "AND datname = current_database()")
                    if cursor.fetchone()[0]:
                        waited = True
                        break
                    time.sleep(0.05)
        finally:
            watcher.close()
    finally:
        go.set()
        d.join(20)
        c.join(20)
    assert errors == {}
    assert no_stripe == []
    assert waited
    _not_charged(top_up, "deactivated")


# ------------------------------------------------------------------------------------ auto top-up turned off, changed


@pytest.mark.django_db
def test_a_pending_automatic_top_up_is_not_charged_after_its_owner_turned_auto_top_up_off(
        clock, api, localstripe, settings, no_task_queue):
    settings.BILLING_TOP_UP_RECONCILE_AFTER_S = 300
    card = save_card(api)["id"]
    _auto_top_up_on(api, card)
    fund(api.user, "1")
    top_up = auto_top_up_start(user_id=api.user.pk)  # its charge task is queued on commit (here: recorded)
    assert top_up is not None and top_up.status == "pending"
    clock.advance(30)
    r = api.patch("/api/v1/billing/profile/", {"auto_top_up_enabled": False}, format="json")
    assert r.status_code == 200 and r.json()["auto_top_up_enabled"] is False
    # The charge task was lost (broker restart) or is late: the per-minute follow-up takes what is still pending.
    clock.advance(600)
    # (the model's default created_at reads the real clock, not the test's)
    TopUp.objects.filter(pk=top_up.pk).update(created_at=clock.now - timedelta(seconds=630))
    reconcile.top_ups_charge_pending()
    _not_charged(top_up, "turned off")
    assert balance(api.user) == 1_000_000
    # The task, late, finds it ended.
    top_up_charge_by_id(top_up_id=top_up.pk)
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.FAILED and top_up.payment_intent_id is None
    assert api.get(f"/api/v1/billing/top-ups/{top_up.pk}/").json()["status"] == "failed"


@pytest.mark.django_db
@pytest.mark.parametrize("change", ["amount", "card"])
def test_a_pending_automatic_top_up_is_not_charged_after_its_card_or_amount_changed(
        api, no_stripe, no_task_queue, change, django_capture_on_commit_callbacks):
    first = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_1")
    other = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_2")
    _auto_top_up_on(api, first.pk)
    fund(api.user, "1")
    top_up = auto_top_up_start(user_id=api.user.pk)
    assert top_up is not None
    if change == "amount":
        _auto_top_up_on(api, first.pk, amount="50.00")
    else:
        _auto_top_up_on(api, other.pk)
    top_up_charge_by_id(top_up_id=top_up.pk)
    assert no_stripe == []
    _not_charged(top_up, "changed")
    # The next tick starts one with the settings as they are now (the one ended before the change holds none back).
    no_task_queue.clear()
    with django_capture_on_commit_callbacks(execute=True):
        usage_meter_tick()
    [new] = TopUp.objects.filter(user=api.user, status=TopUpStatus.PENDING)
    assert (new.amount_micros, new.card_id) == ((50_000_000, first.pk) if change == "amount"
                                                else (20_000_000, other.pk))
    assert [q for q in no_task_queue if q[0] == "top_up_charge"] == [("top_up_charge", (new.pk,))]


@pytest.mark.django_db
def test_a_pending_automatic_top_up_still_wanted_is_charged(clock, api, localstripe, no_task_queue):
    """Turned off and on again with the same card and amount before its charge: still what the owner asks for."""
    card = save_card(api)["id"]
    _auto_top_up_on(api, card)
    fund(api.user, "1")
    top_up = auto_top_up_start(user_id=api.user.pk)
    assert top_up is not None
    assert api.patch("/api/v1/billing/profile/", {"auto_top_up_enabled": False}, format="json").status_code == 200
    _auto_top_up_on(api, card)
    top_up_charge_by_id(top_up_id=top_up.pk)
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.PROCESSING and top_up.payment_intent_id
