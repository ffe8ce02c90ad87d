"""notify(): once per dedupe key, written with the caller's transaction, delivered on the channels the user chose:
the in-app list, an e-mail (Django's mail outbox), and each active webhook endpoint."""
import pytest
from django.core import mail
from django.db import transaction

from notifications.models import Kind, Notification, WebhookDelivery
from notifications.services import notify as svc
from notifications.services import webhooks

from .conftest import run_queued

pytestmark = pytest.mark.django_db


def _notify(user, key="k1", kind=Kind.PAYOUT_SENT):
    return svc.notify(user=user, kind=kind, payload={"payout": 4, "amount": "12.50", "message": "Sent to you."},
                      dedupe_key=key)


def test_one_notification_per_dedupe_key_and_per_user(owner, other_api, queued, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        first = _notify(owner)
        again = _notify(owner)
        theirs = _notify(other_api.user)
    assert first is not None and again is None and theirs is not None
    assert Notification.objects.filter(user=owner).count() == 1
    assert first.title == "Payout 4 sent: $12.50" and first.body == "Sent to you."
    assert [name for name, _ in queued] == ["notifications.tasks.email_send"] * 2  # one per notification


def test_a_rolled_back_event_tells_nobody(owner, queued, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(RuntimeError), transaction.atomic():
            _notify(owner)
            raise RuntimeError("the state change failed")
    assert not Notification.objects.exists() and queued == []


def test_every_channel_by_default_email_through_the_outbox(owner, receiver, queued,
                                                          django_capture_on_commit_callbacks):
    webhooks.endpoint_create(user=owner, url=receiver.url)
    with django_capture_on_commit_callbacks(execute=True):
        notification = _notify(owner)
    run_queued(queued)
    assert notification.in_app
    assert len(mail.outbox) == 1 and mail.outbox[0].to == [owner.email]
    assert "Payout 4 sent" in mail.outbox[0].subject and "Sent to you." in mail.outbox[0].body
    assert len(receiver.requests) == 1
    notification.refresh_from_db()
    assert notification.emailed_at is not None
    run_queued([("notifications.tasks.email_send", (notification.pk,))])  # a task delivered twice: one e-mail
    assert len(mail.outbox) == 1


def test_preferences_are_honoured_per_kind_and_channel(owner, receiver, queued, django_capture_on_commit_callbacks):
    webhooks.endpoint_create(user=owner, url=receiver.url)
    paused, _ = webhooks.endpoint_create(user=owner, url=receiver.url + "/paused")
    webhooks.endpoint_update(endpoint=paused, active=False)
    svc.preference_set(user=owner, kind=Kind.PAYOUT_SENT, in_app=False, email=False, webhook=True)
    svc.preference_set(user=owner, kind=Kind.CREDIT_POSTED, in_app=True, email=True, webhook=False)
    with django_capture_on_commit_callbacks(execute=True):
        payout = _notify(owner, "payout")
        credit = _notify(owner, "credit", kind=Kind.CREDIT_POSTED)
        low = _notify(owner, "low", kind=Kind.LOW_BALANCE)  # no preference: every channel
    run_queued(queued)
    assert not payout.in_app and credit.in_app and low.in_app
    assert sorted(m.subject.split("] ", 1)[1] for m in mail.outbox) == sorted([credit.title, low.title])
    kinds = [r["body"] for r in receiver.requests]
    assert len(kinds) == 2 and all(b'"credit_posted"' not in body for body in kinds)
    assert all(r["path"] == "/hooks/gpumarket" for r in receiver.requests)  # the paused endpoint got nothing
    assert set(WebhookDelivery.objects.values_list("kind", flat=True)) == {"payout_sent", "low_balance"}


def test_a_user_without_email_gets_no_email_task(queued, django_capture_on_commit_callbacks):
    from tests.factories import user_without_address

    user = user_without_address()
    with django_capture_on_commit_callbacks(execute=True):
        _notify(user)
    assert queued == []


def test_unknown_kinds_and_empty_keys_are_programming_errors(owner):
    with pytest.raises(ValueError):
        svc.notify(user=owner, kind="nope", payload={}, dedupe_key="x")
    with pytest.raises(ValueError):
        svc.notify(user=owner, kind=Kind.TEST, payload={}, dedupe_key="x")
    with pytest.raises(ValueError):
        svc.notify(user=owner, kind=Kind.LOW_BALANCE, payload={}, dedupe_key="")
