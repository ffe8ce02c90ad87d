"""A webhook endpoint deleted while its events are written, tested or sent, and two attempts of one delivery at once
(found by review).

A delivery and its attempts are rows under the endpoint (CASCADE). Before, a row was read or locked, the lock let go
(the POST is made outside any transaction), and a child row was then written for a parent that the user's DELETE had
removed meanwhile: the worker's task died on an IntegrityError, and in notify() the caller's own transaction (a
payout, a credit) failed at its commit. Each test here runs the user's DELETE on its own database connection, as the
web process would."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from notifications.models import DeliveryStatus, Kind, Notification, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from notifications.services import webhooks
from notifications.services.notify import notify


class Elsewhere:
    """`call` run on another thread (its own database connection): the user's request, concurrent with the test's."""

    def __init__(self, call):
        self.error: BaseException | None = None
        self.done = threading.Event()

        def run():
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 (reported by the test)
                self.error = exc
            finally:
                connection.close()
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finished_within(self, seconds: float) -> bool:
        return self.done.wait(seconds)


def _delete(endpoint_id: int):
    return lambda: webhooks.endpoint_delete(endpoint=WebhookEndpoint.objects.get(pk=endpoint_id))


@pytest.mark.django_db(transaction=True)
def test_an_endpoint_deleted_while_its_attempt_is_in_flight_ends_the_attempt_quietly(owner, receiver, monkeypatch):
    """The DELETE commits while the worker's POST is in flight (the claim's lock is let go before it): the attempt
    then has no delivery to record itself on, and ends as "nothing to do" instead of an IntegrityError."""
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    real_post = webhooks._post

    def post_then_deleted(d):
        answer = real_post(d)
        deleting = Elsewhere(_delete(endpoint.pk))
        assert deleting.finished_within(10) and deleting.error is None
        return answer

    monkeypatch.setattr(webhooks, "_post", post_then_deleted)
    assert webhooks.webhook_attempt(delivery_id=delivery.pk) is None
    assert len(receiver.requests) == 1
    assert not WebhookEndpoint.objects.exists() and not WebhookAttempt.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_endpoint_deleted_while_an_attempt_is_recorded_goes_with_that_attempt(owner, receiver):
    """The worker records its attempt (the delivery's row locked, the attempt inserted) while the user deletes the
    endpoint: the DELETE waits for that, then removes the delivery with its log, rather than failing on the attempt
    it had not seen (a 500 for the user)."""
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    with transaction.atomic():  # the worker's record step, as webhook_attempt makes it
        WebhookDelivery.objects.select_for_update().get(pk=delivery.pk)
        WebhookAttempt.objects.create(delivery_id=delivery.pk, number=1, status_code=200)
        deleting = Elsewhere(_delete(endpoint.pk))
        assert not deleting.finished_within(1), "the DELETE did not wait for the attempt being recorded"
    assert deleting.finished_within(10) and deleting.error is None, deleting.error
    assert not WebhookEndpoint.objects.exists() and not WebhookAttempt.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_endpoint_deleted_while_an_event_is_written_for_it_does_not_fail_the_callers_transaction(owner, receiver):
    """notify() runs inside the caller's transaction (a payout, a credit) and writes a delivery per active endpoint;
    a DELETE of one committed before that transaction's end made its commit fail on the delivery's foreign key:
    the payout itself was rolled back. Now the DELETE waits for the caller's commit, and takes the delivery along."""
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    with transaction.atomic():  # the caller's transaction
        notification = notify(user=owner, kind=Kind.PAYOUT_SENT, payload={"payout": 1, "amount": "5"},
                              dedupe_key="payout_sent:1")
        deleting = Elsewhere(_delete(endpoint.pk))
        assert not deleting.finished_within(1), "the DELETE did not wait for the event being written"
    assert deleting.finished_within(10) and deleting.error is None, deleting.error
    assert Notification.objects.filter(pk=notification.pk).exists()
    assert not WebhookEndpoint.objects.exists() and not WebhookDelivery.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_endpoint_deleted_while_its_test_event_is_written_is_deleted_after_it(owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    with transaction.atomic():  # the request's transaction around the test event
        webhooks.endpoint_test(endpoint=endpoint)
        deleting = Elsewhere(_delete(endpoint.pk))
        assert not deleting.finished_within(1), "the DELETE did not wait for the test event being written"
    assert deleting.finished_within(10) and deleting.error is None, deleting.error
    assert not WebhookEndpoint.objects.exists() and not WebhookDelivery.objects.exists()


@pytest.mark.django_db
def test_a_test_event_for_an_endpoint_deleted_meanwhile_is_a_404(owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).delete()  # deleted after the request read it
    from core.errors import NotFound

    with pytest.raises(NotFound):
        webhooks.endpoint_test(endpoint=endpoint)
    assert not WebhookDelivery.objects.exists()


# ------------------------------------------------------------------------------ one attempt at a time


def _in_flight(owner, receiver, *, claimed_s_ago: float):
    """A delivery whose attempt a worker claimed `claimed_s_ago` and has not recorded yet, overdue by ten minutes."""
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    assert webhooks._claim(delivery.pk) is not None  # the worker's claim: its POST is in flight
    long_ago = timezone.now() - timedelta(minutes=10)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        next_attempt_at=long_ago, claimed_at=timezone.now() - timedelta(seconds=claimed_s_ago))
    return delivery


@pytest.mark.django_db
def test_the_resender_skips_a_delivery_whose_attempt_is_in_flight(owner, receiver, queued):
    """A queue backlog over five minutes made the resender queue a delivery whose attempt was running: two attempts
    of one delivery at once (two POSTs of one event, the second counted against the limit)."""
    _in_flight(owner, receiver, claimed_s_ago=1)
    assert webhooks.deliveries_resend() == 0 and queued == []


@pytest.mark.django_db
def test_a_second_attempt_is_not_made_while_one_is_in_flight(owner, receiver):
    delivery = _in_flight(owner, receiver, claimed_s_ago=1)
    assert webhooks.webhook_attempt(delivery_id=delivery.pk) is None  # a duplicate task: nothing sent
    delivery.refresh_from_db()
    assert receiver.requests == [] and delivery.attempts == 1 and delivery.status == DeliveryStatus.PENDING


@pytest.mark.django_db
def test_an_attempt_lost_with_its_worker_is_resent_once_its_time_is_up(owner, receiver, queued, settings):
    delivery = _in_flight(owner, receiver, claimed_s_ago=webhooks.in_flight_bound_s() + 1)
    # Queued after the lost attempt (counted at its claim): it is the one to make the next.
    assert webhooks.deliveries_resend() == 1 and queued == [("notifications.tasks.webhook_deliver", (delivery.pk, 1))]
    attempt = webhooks.webhook_attempt(delivery_id=delivery.pk, after_attempts=1)
    assert attempt is not None and (attempt.number, attempt.status_code) == (2, 200)
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.SUCCEEDED and delivery.claimed_at is None


@pytest.mark.django_db
def test_a_recorded_attempt_ends_its_claim(owner, receiver, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 3
    receiver.answers = [500]
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    started = time.monotonic()
    first = webhooks.webhook_attempt(delivery_id=delivery.pk)
    assert first is not None and first.retry_in_s is not None
    delivery.refresh_from_db()
    assert delivery.claimed_at is None  # recorded: the retry may claim it at once
    second = webhooks.webhook_attempt(delivery_id=delivery.pk)
    assert second is not None and second.status_code == 200 and time.monotonic() - started < 10
