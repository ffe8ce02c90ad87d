"""An endpoint is paused by the platform only when every attempt failed for DISABLE_AFTER (three days) AND at least
DISABLE_MIN_FAILED_EVENTS events failed since. Before, the days alone decided: an endpoint whose events are rare (one
every four days) was paused after its second failed event, two failures in four days."""
from datetime import timedelta

import pytest
from django.utils import timezone

from notifications.models import Kind, Notification, WebhookAttempt, WebhookEndpoint
from notifications.services import webhooks

ATTEMPTS = 3  # each event is tried this many times: its retries are one failure, not three


class Clock:
    def __init__(self):
        self.now = timezone.now()

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("django.utils.timezone.now", c)
    return c


@pytest.fixture
def failing(owner, receiver, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = ATTEMPTS
    receiver.answers = [500] * 100
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    return endpoint


def _event_fails(endpoint, clock, *, attempts: int = ATTEMPTS) -> WebhookEndpoint:
    """One event sent to the endpoint, each of its attempts failing (a minute apart, as its retries would)."""
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    for _ in range(attempts):
        attempt = webhooks.webhook_attempt(delivery_id=delivery.pk)
        assert attempt is not None and attempt.error.startswith("Answered 500")
        clock.now += timedelta(minutes=1)
    return WebhookEndpoint.objects.get(pk=endpoint.pk)


def test_two_failed_events_four_days_apart_do_not_pause_an_endpoint_of_rare_events(failing, clock, owner):
    first = clock.now
    assert _event_fails(failing, clock).active
    clock.now = first + timedelta(days=4)
    endpoint = _event_fails(failing, clock, attempts=1)  # its first attempt: failing for four days now
    assert endpoint.active and endpoint.disabled_at is None and endpoint.disabled_reason == ""
    assert endpoint.failing_since == first  # still counted from the first failure
    assert WebhookAttempt.objects.filter(delivery__endpoint=failing).count() == ATTEMPTS + 1
    assert not Notification.objects.filter(user=owner, kind=Kind.WEBHOOK_ENDPOINT_DISABLED).exists()


def test_an_endpoint_is_paused_once_enough_events_failed_over_the_days(failing, clock, owner):
    first = clock.now
    # Four events over three and a half days: the days are past, the failed events too few.
    for day in (0, 1, 2, 3.5):
        clock.now = first + timedelta(days=day)
        assert _event_fails(failing, clock).active
    # The fifth failed event pauses it.
    clock.now = first + timedelta(days=4)
    endpoint = _event_fails(failing, clock, attempts=1)
    assert endpoint.active is False and endpoint.disabled_at == first + timedelta(days=4)
    assert endpoint.disabled_reason == (
        f"Paused by the platform: no attempt to deliver an event to it succeeded since {first:%Y-%m-%d %H:%M} UTC "
        f"(3 days or more, {webhooks.DISABLE_MIN_FAILED_EVENTS} events or more failed). Events are not sent to it "
        "until you resume it.")
    told = Notification.objects.get(user=owner, kind=Kind.WEBHOOK_ENDPOINT_DISABLED)
    assert endpoint.disabled_reason in told.body


def test_many_failed_events_within_three_days_do_not_pause_it_yet(failing, clock):
    first = clock.now
    for hours in range(0, 70, 10):  # seven events within three days
        clock.now = first + timedelta(hours=hours)
        assert _event_fails(failing, clock, attempts=1).active
    clock.now = first + timedelta(days=3)
    assert _event_fails(failing, clock, attempts=1).active is False


def test_failures_before_a_delivered_attempt_are_not_counted(failing, clock, receiver):
    first = clock.now
    for hours in range(0, 40, 10):  # four failed events
        clock.now = first + timedelta(hours=hours)
        _event_fails(failing, clock, attempts=1)
    receiver.answers = [200]
    clock.now = first + timedelta(hours=41)
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=failing).pk)  # delivered
    receiver.answers = [500] * 100
    restart = first + timedelta(hours=42)
    clock.now = restart
    _event_fails(failing, clock, attempts=1)
    clock.now = restart + timedelta(days=4)
    endpoint = _event_fails(failing, clock, attempts=1)  # failing four days, two failed events since the delivery
    assert endpoint.active and endpoint.failing_since == restart
