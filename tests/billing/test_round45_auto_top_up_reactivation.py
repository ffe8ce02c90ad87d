"""An account turned off and on again: its auto top-up is re-armed at once, and charges once.

Deactivating an account leaves its owner's auto top-up setting as it was; while it is off the platform charges
no card (a pending automatic top-up ends as not charged: tests/billing/test_round45_auto_top_up.py). Before, once
the account was turned on again with its balance below the threshold, the next automatic top-up waited: the one
the deactivation had ended counted as a failure of the last hour (AUTO_TOP_UP_RETRY_AFTER), so every tick for up
to an hour started none, and its running instances could be stopped at zero meanwhile. Now the reactivation starts
it at once (after its commit) and a top-up ended before its charge holds none back; the charge's re-check under
the billing profile's lock still stands, so the tick beside it adds no second one. localstripe is Stripe."""
import pytest

from billing.models import BillingProfile, TopUp, TopUpStatus
from billing.services.top_ups import NOT_CHARGED_DEACTIVATED, auto_top_up_start, top_up_charge_by_id
from billing.tasks import usage_meter_tick
from marketplace.models import User
from marketplace.services.account_status import account_deactivate, account_reactivate
from tests.billing.helpers import balance, fund
from tests.billing.test_payments import save_card
from tests.billing.test_round45_auto_top_up import _auto_top_up_on
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _charges(queued) -> list[int]:
    return [args[0] for name, args in queued if name == "top_up_charge"]


@pytest.fixture
def turned_off_with_a_top_up_ended(clock, api, localstripe, no_task_queue, django_capture_on_commit_callbacks):
    """Auto top-up on ($5 threshold, $20), the balance $1: a top-up started; the account is deactivated before its
    charge, which then ends it as not charged."""
    card = save_card(api)["id"]
    _auto_top_up_on(api, card)
    clock.advance(600)  # set up a while ago; the balance falls below the threshold now
    fund(api.user, "1")
    ended = auto_top_up_start(user_id=api.user.pk)
    assert ended is not None
    TopUp.objects.filter(pk=ended.pk).update(created_at=clock.now)  # (the model's default reads the real clock)
    operator = UserFactory(is_staff=True)
    with django_capture_on_commit_callbacks(execute=True):
        account_deactivate(user=User.objects.get(pk=api.user.pk), by=operator, reason="checking a payment")
    top_up_charge_by_id(top_up_id=ended.pk)
    ended.refresh_from_db()
    assert (ended.status, ended.failure_message, ended.payment_intent_id) == (
        TopUpStatus.FAILED, NOT_CHARGED_DEACTIVATED, None)
    assert BillingProfile.objects.get(user=api.user).auto_top_up_enabled is True  # its owner's setting, kept
    clock.advance(300)
    no_task_queue.clear()
    return api.user, operator, ended


def test_reactivation_rearms_auto_top_up_at_once_and_it_charges_once(
        turned_off_with_a_top_up_ended, clock, no_task_queue, django_capture_on_commit_callbacks):
    owner, operator, ended = turned_off_with_a_top_up_ended
    with django_capture_on_commit_callbacks(execute=True):
        account_reactivate(user=User.objects.get(pk=owner.pk), by=operator, reason="payment checked")
    # Started by the reactivation itself, not by a tick: one top-up, its charge queued.
    [started] = TopUp.objects.filter(user=owner, automatic=True).exclude(pk=ended.pk)
    assert (started.status, started.amount_micros) == (TopUpStatus.PENDING, 20_000_000)
    assert _charges(no_task_queue) == [started.pk]
    # The tick a moment later (and the one after): nothing more while it is under way.
    with django_capture_on_commit_callbacks(execute=True):
        usage_meter_tick()
    clock.advance(60)
    with django_capture_on_commit_callbacks(execute=True):
        usage_meter_tick()
    assert TopUp.objects.filter(user=owner, automatic=True).count() == 2
    assert _charges(no_task_queue) == [started.pk]
    # The charge goes out (its re-check under the profile's lock passes: on, same card and amount, account active).
    top_up_charge_by_id(top_up_id=started.pk)
    top_up_charge_by_id(top_up_id=started.pk)  # the task delivered twice: charged once
    started.refresh_from_db()
    assert started.status == TopUpStatus.PROCESSING and started.payment_intent_id
    assert TopUp.objects.filter(user=owner, payment_intent_id__isnull=False).count() == 1
    assert balance(owner) == 1_000_000  # credited by the webhook, not here


def test_without_the_reactivations_own_start_the_next_tick_starts_it(
        turned_off_with_a_top_up_ended, no_task_queue, django_capture_on_commit_callbacks):
    """The top-up the deactivation ended (never sent to the card) holds the next one back no more: were the
    reactivation's own start lost, the next tick starts it (before, none for up to an hour)."""
    owner, operator, ended = turned_off_with_a_top_up_ended
    User.objects.filter(pk=owner.pk).update(is_active=True)  # turned on some other way: no re-arm of its own
    with django_capture_on_commit_callbacks(execute=True):
        usage_meter_tick()
    [started] = TopUp.objects.filter(user=owner, automatic=True, status=TopUpStatus.PENDING)
    assert _charges(no_task_queue) == [started.pk]


def test_reactivation_starts_none_above_the_threshold(
        turned_off_with_a_top_up_ended, no_task_queue, django_capture_on_commit_callbacks):
    owner, operator, ended = turned_off_with_a_top_up_ended
    fund(owner, "10")  # $11: above the $5 threshold
    with django_capture_on_commit_callbacks(execute=True):
        account_reactivate(user=User.objects.get(pk=owner.pk), by=operator)
    assert list(TopUp.objects.filter(user=owner).values_list("pk", flat=True)) == [ended.pk]
    assert _charges(no_task_queue) == []
    # Again (already on): nothing.
    with django_capture_on_commit_callbacks(execute=True):
        assert account_reactivate(user=User.objects.get(pk=owner.pk), by=operator) is None
    assert TopUp.objects.filter(user=owner).count() == 1


def test_reactivation_starts_none_when_auto_top_up_is_off(
        turned_off_with_a_top_up_ended, no_task_queue, django_capture_on_commit_callbacks):
    owner, operator, ended = turned_off_with_a_top_up_ended
    BillingProfile.objects.filter(user=owner).update(auto_top_up_enabled=False)
    with django_capture_on_commit_callbacks(execute=True):
        account_reactivate(user=User.objects.get(pk=owner.pk), by=operator)
    assert TopUp.objects.filter(user=owner).count() == 1 and _charges(no_task_queue) == []
