"""notify() keeps one notice per dedupe key even for keys longer than the column (200): two keys that differ only
after their 200th character are two events, each told (they were cut to 200 and the second was dropped as a
repeat); a retry of the same long key is still told once."""

import pytest

from notifications.models import Kind, Notification
from notifications.services import notify as svc

pytestmark = pytest.mark.django_db


def _notify(user, key):
    return svc.notify(user=user, kind=Kind.PAYOUT_SENT, payload={"payout": 4, "amount": "1.00"}, dedupe_key=key)


def test_long_keys_differing_after_the_column_length_are_two_notices(owner, queued):
    stem = "payout_sent:" + "x" * 250
    first, second = _notify(owner, stem + ":a"), _notify(owner, stem + ":b")
    assert first is not None and second is not None
    assert _notify(owner, stem + ":a") is None and _notify(owner, stem + ":b") is None  # retries: once each
    assert Notification.objects.filter(user=owner).count() == 2
    assert all(len(n.dedupe_key) <= 200 for n in Notification.objects.filter(user=owner))


def test_keys_up_to_the_column_length_are_stored_as_given(owner, queued):
    key = "k" * 200
    assert _notify(owner, key).dedupe_key == key
    assert _notify(owner, key) is None
