"""Round 47 (suspected, not reproduced by the reviewer): the web page's endpoint delete, raced by a delete of the
same endpoint elsewhere (the API, another tab) between the page's lookup and the service's. Reproduced with real
PostgreSQL row locks: the other delete holds the row while the page looks it up, and commits while the page's
delete waits on the lock. No 500: the service finds the row gone under its lock and does nothing
(webhooks.endpoint_delete); the page then says it is deleted, which it is."""
import threading
import time

import pytest
from django.db import connections, transaction
from django.test import Client

from notifications.models import WebhookEndpoint
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_endpoint_deleted_elsewhere_between_lookup_and_delete_is_no_500():
    owner = UserFactory()
    endpoint = WebhookEndpoint.objects.create(user=owner, url="https://hooks.example.com/in",
                                              secret_encrypted=b"x", secret_hint="whsec_ab")
    held, go_on, errors = threading.Event(), threading.Event(), []

    def delete_elsewhere():  # as the API's delete: the row locked, then gone at commit
        try:
            with transaction.atomic():
                WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
                held.set()
                go_on.wait(10)
                WebhookEndpoint.objects.filter(pk=endpoint.pk).delete()
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            held.set()
            connections.close_all()

    other = threading.Thread(target=delete_elsewhere)
    other.start()
    assert held.wait(10)
    web = Client(raise_request_exception=False)
    web.force_login(owner)
    seen_waiting: list[bool] = []

    def release_once_the_page_waits():
        # The page's lookup reads the row (a plain read is not blocked); its delete then waits on the other's lock:
        # seen in pg_stat_activity, and only then does the other delete commit.
        try:
            with connections["default"].cursor() as cursor:
                for _ in range(200):
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND wait_event_type = 'Lock'")
                    if cursor.fetchone()[0]:
                        seen_waiting.append(True)
                        break
                    time.sleep(0.05)
        finally:
            go_on.set()
            connections.close_all()

    watcher = threading.Thread(target=release_once_the_page_waits)
    watcher.start()
    answer = web.post(f"/account/notifications/webhooks/{endpoint.pk}/delete/")
    other.join(10)
    watcher.join(10)
    assert seen_waiting, "the page's delete never waited on the other's lock: no race exercised"
    assert not errors, errors
    assert answer.status_code == 302, answer.status_code
    assert not WebhookEndpoint.objects.filter(pk=endpoint.pk).exists()
    # Already gone before the click: a 404, as for another user's endpoint.
    assert web.post(f"/account/notifications/webhooks/{endpoint.pk}/delete/").status_code == 404
