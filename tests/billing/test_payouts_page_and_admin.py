"""The provider's payouts page says what each payout is (the list holds pending and failed ones, not only those sent),
and the admin's "send again" / "process again" run only for staff holding their permission, a crafted POST too."""
from datetime import UTC, date, datetime, timedelta

import pytest
from django.utils import timezone

from billing.models import Payout, PayoutStatus, StripeEvent, StripeEventStatus
from billing.services import payouts
from tests.billing.test_payouts_shown import _earn, _provider, _to, connect  # noqa: F401 (connect: a fixture)
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, staff

pytestmark = pytest.mark.django_db

MONDAY = date(2026, 3, 9)  # the run for the week 2026-03-02 .. 2026-03-08


def _payouts_section(provider) -> str:
    page = logged_in(provider).get("/payouts/").content.decode()
    return page[page.index('<section aria-labelledby="payouts-h">'):]


def test_the_payouts_list_says_pending_and_failed_not_sent(clock, connect):  # noqa: F811 (the fixture)
    """Review: the list was headed "Sent" while it held pending payouts too, and said nothing of a payout whose
    transfer Stripe had not confirmed (tried again automatically). Stripe's raw message there ("Try again in a
    minute") is addressed to the caller, not the provider, who can do nothing: it is not shown."""
    provider = _provider()
    _earn(clock, provider, hours=5)
    connect.mode = "down"  # the transfer's outcome is not known: it stays pending with the error recorded
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING and payout.failure_message and payout.attempts == 1
    section = _payouts_section(provider)
    assert ">Sent<" not in section and ">Weekly payouts<" in section
    assert ">pending<" in section and ">paid<" not in section
    assert "Stripe has not confirmed the last try yet; it is tried again automatically" in section
    assert payout.failure_message not in section and "Try again in a minute" not in section

    connect.mode = "refuse"  # Stripe refuses for good: failed, its earnings given back
    payouts.payouts_send_pending(now=clock.now + timedelta(days=1))
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.FAILED
    section = _payouts_section(provider)
    assert ">failed<" in section and "No such destination" in section
    assert "The amount is back in your earnings" in section and "not confirmed the last try" not in section


def test_a_paid_payout_reads_paid_with_no_retry_note(clock, connect):  # noqa: F811 (the fixture)
    provider = _provider()
    _earn(clock, provider, hours=5)
    connect.mode = "down"
    [payout] = payouts.payouts_run(today=MONDAY)
    connect.mode = "ok"
    _to(clock, datetime(2026, 3, 9, 12, 0, tzinfo=UTC))
    payouts.payouts_send_pending(now=clock.now + timedelta(days=1))
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.failure_message == ""
    section = _payouts_section(provider)
    assert ">Weekly payouts<" in section and ">paid<" in section
    assert "not confirmed" not in section and ">pending<" not in section


def _pending_payout(clock, connect) -> Payout:  # noqa: F811 (the fixture)
    """A pending payout whose first try got no answer (Stripe down); Stripe answers again afterwards."""
    provider = _provider()
    _earn(clock, provider, hours=5)
    connect.mode = "down"
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING
    connect.mode = "ok"
    connect.requests.clear()
    connect.lookups.clear()
    return payout


def test_send_again_is_refused_to_staff_without_the_payout_permission_a_crafted_post_too(clock, connect):  # noqa: F811
    payout = _pending_payout(clock, connect)
    viewer = logged_in(staff("billing.view_payout"))
    r = act(viewer, "billing/payout", "send_again", payout.pk)  # no action of theirs: the list again
    assert r.status_code == 200 and b"send_again" not in r.content  # nor offered
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PENDING and payout.attempts == 1
    assert connect.requests == [] and connect.lookups == [], "a view-only staff account reached Stripe"
    # The permission: sent (the earlier try looked up first, then the transfer made)
    act(logged_in(staff("billing.view_payout", "billing.change_payout")), "billing/payout", "send_again", payout.pk)
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and len(connect.requests) == 1


def test_process_again_is_refused_to_staff_without_the_event_permission_a_crafted_post_too():
    event = StripeEvent.objects.create(event_id="evt_test_1", type="customer.created", payload={
        "id": "evt_test_1", "type": "customer.created", "data": {"object": {"id": "cus_1", "object": "customer"}}},
        status=StripeEventStatus.FAILED, error="RuntimeError: boom", processed_at=timezone.now())
    act(logged_in(staff("billing.view_stripeevent")), "billing/stripeevent", "process_again", event.pk)
    event.refresh_from_db()
    assert event.status == StripeEventStatus.FAILED and event.error == "RuntimeError: boom"
    act(logged_in(staff("billing.view_stripeevent", "billing.change_stripeevent")), "billing/stripeevent",
        "process_again", event.pk)
    event.refresh_from_db()
    assert event.status != StripeEventStatus.FAILED
