"""Round 53 review of notifications (hooks): a pause or a test event held up by a notice being written, the
resenders undoing a recorded backoff, and endpoint writes that resolve a name the user chose, unthrottled."""
import threading

import pytest
from django.db import connection, transaction

from notifications.models import Kind
from notifications.services import webhooks
from notifications.services.notify import notify
from tests.factories import UserFactory

# What a user does to an endpoint while another app's transaction that told them something is still open.
ACTIONS = {
    "pause": lambda user, endpoint: webhooks.endpoint_update(endpoint=endpoint, active=False),
    "patch_description": lambda user, endpoint: webhooks.endpoint_update(endpoint=endpoint, description="x"),
    "test_button": lambda user, endpoint: webhooks.endpoint_test(endpoint=endpoint),
    "add_endpoint": lambda user, endpoint: webhooks.endpoint_create(user=user, url="http://127.0.0.1:10/hooks"),
}


@pytest.mark.parametrize("action", list(ACTIONS))
@pytest.mark.django_db(transaction=True)
def test_a_pause_or_test_event_is_not_held_up_by_a_notice_being_written(action):
    """notify() keeps the user's active endpoints FOR KEY SHARE until its caller commits; endpoint_update and
    endpoint_test locked the endpoint FOR UPDATE, which waits for that: Pause, PATCH and the test button hung until
    the other transaction committed (up to gunicorn's timeout, then a 502). Now FOR NO KEY UPDATE."""
    user = UserFactory()
    endpoint, _ = webhooks.endpoint_create(user=user, url="http://127.0.0.1:9/hooks")
    started, release = threading.Event(), threading.Event()

    def notifier():  # another app's transaction that told the user something, not committed yet
        try:
            with transaction.atomic():
                notify(user=user, kind=Kind.LOW_BALANCE, payload={"message": "low"}, dedupe_key="k-share")
                started.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=notifier)
    thread.start()
    assert started.wait(10)
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '1s'")
            ACTIONS[action](user, endpoint)
    finally:
        release.set()
        thread.join()


@pytest.mark.django_db(transaction=True)
def test_a_delete_still_waits_for_a_pause_in_progress():
    """NO KEY UPDATE still excludes endpoint_delete's FOR UPDATE: the endpoint stays until the pause commits."""
    user = UserFactory()
    endpoint, _ = webhooks.endpoint_create(user=user, url="http://127.0.0.1:9/hooks")
    locked, release = threading.Event(), threading.Event()

    def pauser():
        try:
            with transaction.atomic():
                webhooks.endpoint_update(endpoint=endpoint, active=False)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=pauser)
    thread.start()
    assert locked.wait(10)
    try:
        with pytest.raises(Exception, match="lock timeout"):
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL lock_timeout = '1s'")
                webhooks.endpoint_delete(endpoint=endpoint)
    finally:
        release.set()
        thread.join()
