"""`vastai start instance` with a label in the same PUT (`{"label": ..., "state": "running"}`) while its provider
retires the node, on real PostgreSQL with a connection per thread (found by review). The PUT wrote the label first
(its UPDATE locks the instance's row) and then started the instance, whose first lock is the node's row (FOR
SHARE): instance, then node. A retire locks the node, then its instances (an unreachable node's stopped ones end
failed with it). Each waited for the other and PostgreSQL aborted one ("deadlock detected"): the PUT answered a 500,
or the retire failed. Now the PUT starts the instance first and writes the label after it: node, then instance, as
every other writer of the two."""
import threading
import time

import pytest
from django.db import connection, connections
from rest_framework.test import APIClient

from marketplace.models import Instance, InstanceStatus, NodeState
from marketplace.services import instances as svc
from marketplace.services import nodes as node_svc
from tests.factories import UserFactory, api_key_for, make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db(transaction=True)


def _waiting_for_a_lock_or_done(thread: threading.Thread, seconds: float = 5) -> None:
    """Until a session of this database waits for a row lock, or `thread` has ended."""
    watcher = connections.create_connection("default")
    try:
        deadline = time.monotonic() + seconds
        with watcher.cursor() as cursor:
            while time.monotonic() < deadline and thread.is_alive():
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                               "AND datname = current_database()")
                if cursor.fetchone()[0]:
                    return
                time.sleep(0.05)
    finally:
        watcher.close()


def test_a_put_with_a_label_and_a_start_racing_the_nodes_retire_is_a_clean_409(monkeypatch):
    renter = UserFactory()
    node = make_listed_node(gpu_count=1)
    instance = run(book(renter, node, label="before"))
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    # The server went silent: its retire ends the stopped instance (it locks it after the node).
    type(node).objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=9)
    node.refresh_from_db()

    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(renter)}")

    holding, go = threading.Event(), threading.Event()
    real_unreachable = node_svc.node_unreachable
    errors: dict[str, BaseException] = {}
    answers: dict[str, object] = {}

    def unreachable_once_the_put_waits(node):
        holding.set()  # the retire holds the node's row here, and locks its stopped instances next
        go.wait(10)
        return real_unreachable(node)

    monkeypatch.setattr(node_svc, "node_unreachable", unreachable_once_the_put_waits)

    def retire():
        try:
            node_svc.node_retire(node=node)
        except BaseException as exc:  # noqa: BLE001
            errors["retire"] = exc
        finally:
            connection.close()

    def put():
        try:
            answers["put"] = client.put(f"/compat/vast/api/v0/instances/{instance.pk}/",
                                        {"label": "after", "state": "running"}, format="json")
        except BaseException as exc:  # noqa: BLE001
            errors["put"] = exc
        finally:
            connection.close()

    r, p = threading.Thread(target=retire), threading.Thread(target=put)
    try:
        r.start()
        assert holding.wait(10)
        p.start()
        _waiting_for_a_lock_or_done(p)  # the PUT waits for the node's row
        go.set()
        r.join(20)
        p.join(20)
    finally:
        go.set()
    assert not errors, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    response = answers["put"]
    assert response.status_code == 409, response.content  # the start is refused: no 500
    body = response.json()
    assert body["success"] is False and body["error"] == "conflict" and body["msg"], body
    node.refresh_from_db()
    instance = Instance.objects.get(pk=instance.pk)
    assert node.state == NodeState.RETIRED
    assert (instance.status, instance.label) == (InstanceStatus.FAILED, "before")  # refused: the label unchanged
