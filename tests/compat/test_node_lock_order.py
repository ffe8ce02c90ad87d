"""Compat requests that write an instance's row and then call a service that locks its node, racing the node's
retire, on real PostgreSQL with a connection per thread (found by review). Every writer of both takes the node's row
first, then its instances' (a retire: the node, then an unreachable node's stopped and interrupted instances, which
end failed with it). Taken the other way round, each waited for the other and PostgreSQL aborted one ("deadlock
detected"): the request answered a 500, or the retire failed.

- `vastai start instance` with a label in the same PUT (`{"label": ..., "state": "running"}`) wrote the label first
  (its UPDATE locks the instance's row) and then started it (the node's row, FOR SHARE). Now the state comes first.
- `vastai create instance` sent again once the instance it made is no longer replayed (stopped) gave that
  instance's key up (an UPDATE of its row) before the booking locked the node. Now the node is locked first.
"""
import threading
import time

import pytest
from django.db import connection, connections
from rest_framework.test import APIClient

from marketplace.models import Instance, InstanceStatus, NodeState
from marketplace.services import instances as svc
from marketplace.services import nodes as node_svc
from tests.factories import UserFactory, api_key_for, make_listed_node
from tests.marketplace.renting_helpers import add_key, book, run

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


def _stopped_on_a_silent_node(instance):
    """`instance` stopped, and its node's health checks failing: the node's retire ends the instance (it locks the
    instance's row after the node's)."""
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    node = type(instance.node).objects.get(pk=instance.node_id)
    type(node).objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=9)
    node.refresh_from_db()
    return node


def _client(renter) -> APIClient:
    client = APIClient(raise_request_exception=False)  # a deadlock is the 500 a client gets
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(renter)}")
    return client


def _during_the_retire(monkeypatch, node, request):
    """`request()` sent while the node's retire holds the node's row (paused before it locks the node's
    instances); the retire goes on once the request waits for a lock. The request's answer; no error either side."""
    holding, go = threading.Event(), threading.Event()
    real_unreachable = node_svc.node_unreachable
    errors: dict[str, BaseException] = {}
    answers: dict[str, object] = {}

    def unreachable_once_the_request_waits(node):
        holding.set()  # the retire holds the node's row here, and locks its stopped instances next
        go.wait(10)
        return real_unreachable(node)

    monkeypatch.setattr(node_svc, "node_unreachable", unreachable_once_the_request_waits)

    def retire():
        try:
            node_svc.node_retire(node=node)
        except BaseException as exc:  # noqa: BLE001
            errors["retire"] = exc
        finally:
            connection.close()

    def send():
        try:
            answers["request"] = request()
        except BaseException as exc:  # noqa: BLE001
            errors["request"] = exc
        finally:
            connection.close()

    r, p = threading.Thread(target=retire), threading.Thread(target=send)
    try:
        r.start()
        assert holding.wait(10)
        p.start()
        _waiting_for_a_lock_or_done(p)  # the request waits for the node's row
        go.set()
        r.join(20)
        p.join(20)
    finally:
        go.set()
    assert not r.is_alive() and not p.is_alive(), "hung"
    assert not errors, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    node.refresh_from_db()
    assert node.state == NodeState.RETIRED
    return answers["request"]


def test_a_put_with_a_label_and_a_start_racing_the_nodes_retire_is_a_clean_409(monkeypatch):
    renter = UserFactory()
    instance = run(book(renter, make_listed_node(gpu_count=1), label="before"))
    node = _stopped_on_a_silent_node(instance)
    client = _client(renter)
    response = _during_the_retire(monkeypatch, node, lambda: client.put(
        f"/compat/vast/api/v0/instances/{instance.pk}/", {"label": "after", "state": "running"}, format="json"))
    assert response.status_code == 409, response.content  # the start is refused: no 500
    body = response.json()
    assert body["success"] is False and body["error"] == "conflict" and body["msg"], body
    instance = Instance.objects.get(pk=instance.pk)
    assert (instance.status, instance.label) == (InstanceStatus.FAILED, "before")  # refused: the label unchanged


def test_a_create_sent_again_for_a_stopped_instance_racing_the_nodes_retire_is_a_clean_409(monkeypatch):
    """The create that made the instance sent again (not replayed: the instance is stopped): its key is given up
    in the booking's transaction, after the node's row is locked."""
    renter = UserFactory()
    add_key(renter)
    client = _client(renter)
    node = make_listed_node(gpu_count=2)
    ask = f"/compat/vast/api/v0/asks/{node.pk * 100 + 1}/"
    body = {"image": "cuda-12-4", "disk": 20, "runtype": "ssh"}
    made = client.put(ask, body, format="json")
    assert made.status_code == 200, made.content
    first = Instance.objects.get(pk=made.json()["new_contract"])
    node = _stopped_on_a_silent_node(run(first))
    assert Instance.objects.get(pk=first.pk).idempotency_key.startswith("vast-ask:")
    response = _during_the_retire(monkeypatch, node, lambda: client.put(ask, body, format="json"))
    assert response.status_code == 409, response.content  # the node is retired: no 500
    assert response.json()["success"] is False and "is not available" in response.json()["msg"]
    assert Instance.objects.filter(renter=renter).count() == 1
