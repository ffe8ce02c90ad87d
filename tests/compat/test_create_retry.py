"""A retried `vastai create instance` books once (compat.vast.booking).

The vastai client re-sends the same PUT /asks/ID/ on a 502/503/504, a dropped connection or a timeout; an offer id
stays bookable here (node × 100 + GPUs), so without the replay each retry booked another instance."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from marketplace.models import Gpu, GpuStatus, Instance, Node, SshKey
from marketplace.services import instances as svc
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import add_key

from .test_api import V0, msg


def _create(client, ask_id, headers=None, **body):
    data = {"client_id": "me", "image": "cuda-12-4", "disk": 20.0, "env": {}, "runtype": "ssh", "label": None,
            **body}
    return client.put(f"{V0}/asks/{ask_id}/", data, format="json", **(headers or {}))


def _contract(response) -> int:
    assert response.status_code == 200, response.content
    return response.json()["new_contract"]


@pytest.fixture
def node(db):
    return make_listed_node(gpu_model="rtx-a4000", gpu_count=6, price="0.500000")


def test_the_same_create_sent_again_answers_the_same_instance(api, node):
    add_key(api.user)
    ask = node.pk * 100 + 2
    made = _create(api, ask, label="train")
    first = _contract(made)
    assert "msg" not in made.json()
    again = _create(api, ask, label="train")
    assert _contract(again) == first  # the client's retry, which says so (the CLI prints the answer)
    assert again.json()["msg"].startswith("The same create was sent ") and f"instance {first}," in again.json()["msg"]
    assert "--label" in again.json()["msg"]
    assert _contract(_create(api, ask, label="train")) == first  # and its third try
    assert list(Instance.objects.values_list("pk", flat=True)) == [first]
    assert Gpu.objects.filter(node=node, status=GpuStatus.RENTED).count() == 2
    # Answered before the input is checked again: a key deleted meanwhile does not make the retry a 400.
    SshKey.objects.filter(user=api.user).delete()
    assert _contract(_create(api, ask, label="train")) == first


def test_another_body_offer_or_user_is_another_booking(api, client_for, node):
    add_key(api.user)
    ask = node.pk * 100 + 1
    first = _contract(_create(api, ask, label="a"))
    relabelled = _contract(_create(api, ask, label="b"))
    other_count = _contract(_create(api, node.pk * 100 + 2, label="a"))
    someone = UserFactory()
    add_key(someone)
    theirs = _contract(_create(client_for(someone), ask, label="a"))
    assert len({first, relabelled, other_count, theirs}) == 4
    assert Instance.objects.get(pk=theirs).renter == someone


def test_after_the_window_or_once_its_instance_is_gone_the_same_create_books_again(api, node, settings):
    settings.COMPAT_CREATE_REPLAY_WINDOW_S = 600
    add_key(api.user)
    ask = node.pk * 100 + 1
    first = _contract(_create(api, ask))
    Instance.objects.filter(pk=first).update(created_at=timezone.now() - timedelta(seconds=601))
    second = _contract(_create(api, ask))
    assert second != first
    assert _contract(_create(api, ask)) == second  # the key moved to the new booking
    svc.instance_destroy(instance=Instance.objects.get(pk=second))
    third = _contract(_create(api, ask))
    assert len({first, second, third}) == 3
    assert _contract(_create(api, ask)) == third


def test_an_idempotency_key_is_honoured_as_the_api_does(api, node):
    add_key(api.user)
    ask = node.pk * 100 + 1
    first = _contract(_create(api, ask, headers={"HTTP_IDEMPOTENCY_KEY": "k1"}))
    again = _create(api, ask, headers={"HTTP_IDEMPOTENCY_KEY": "k1"})
    assert _contract(again) == first
    # What books another is another key: another --label with the same key is the 422 below (found by review).
    assert again.json()["msg"].startswith("A create with the same Idempotency-Key was sent ")
    assert "another Idempotency-Key" in again.json()["msg"] and "--label" not in again.json()["msg"]
    reused = _create(api, ask, headers={"HTTP_IDEMPOTENCY_KEY": "k1"}, label="other")
    assert reused.status_code == 422 and "already used for a different request" in msg(reused)
    # Another key is another booking, even of the same body: the header opts out of the implicit replay.
    second = _contract(_create(api, ask, headers={"HTTP_IDEMPOTENCY_KEY": "k2"}))
    assert second != first
    bad = _create(api, ask, headers={"HTTP_IDEMPOTENCY_KEY": "é"})
    assert bad.status_code == 400 and "Idempotency-Key" in msg(bad)
    assert Instance.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_two_identical_creates_at_once_book_once(client_for):
    """Both pass the "booked already?" look-up before either books: the unique index decides, not the look-up."""
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=4, price="0.500000")
    user = UserFactory()
    add_key(user)
    client = client_for(user)
    ask = node.pk * 100 + 2
    results: list = []

    def create():
        try:
            results.append(_create(client, ask))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=create) for _ in range(2)]
    with transaction.atomic():
        # The node's row locked: both creates get past the look-up and wait to read the node for the booking.
        Node.objects.select_for_update().get(pk=node.pk)
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while True:
            with connection.cursor() as cursor:
                # pg_stat_activity is read once per transaction unless its snapshot is dropped: this one is open
                cursor.execute("SELECT pg_stat_clear_snapshot()")
                cursor.execute("SELECT count(*) FROM pg_stat_activity "
                               "WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))")
                if cursor.fetchone()[0] == 2:
                    break
            assert time.monotonic() < deadline, "the two creates never reached the booking"
            time.sleep(0.01)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(results) == 2 and not [r for r in results if isinstance(r, Exception)], results
    assert _contract(results[0]) == _contract(results[1])
    assert Instance.objects.count() == 1
    assert Gpu.objects.filter(node=node, status=GpuStatus.RENTED).count() == 2


def test_a_refused_create_leaves_the_key_on_the_instance_that_held_it(api, node):
    """Giving up a stale holder's key and booking are one transaction: a refused booking (here the node was
    unlisted) left the stopped instance without its key, so a retry after it was started again booked twice."""
    add_key(api.user)
    ask = node.pk * 100 + 1
    first = _contract(_create(api, ask, label="a"))
    svc.instance_stop(instance=svc.instance_mark_running(instance_id=svc.instance_mark_provisioning(
        instance_id=first).pk, ssh_host="10.0.0.1", ssh_port=40001, ssh_user="root"))
    key = Instance.objects.get(pk=first).idempotency_key
    assert key.startswith("vast-ask:")
    Node.objects.filter(pk=node.pk).update(listed=False)
    assert _create(api, ask, label="a").status_code == 409
    assert Instance.objects.get(pk=first).idempotency_key == key
    assert Instance.objects.filter(renter=api.user).count() == 1
