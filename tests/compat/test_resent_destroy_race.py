"""A `destroy instance` the CLI sends again while the first one is committing (found by the second review round):
the first destroys an interrupted instance in the request itself, the resend waits for its row and then finds it
destroyed, which is what it asked for: a success, not a 409."""
import threading

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from marketplace.models import Instance, InstanceStatus, InterruptionCause
from marketplace.services import instances as svc
from marketplace.services.instances.interruptions import instance_interrupt
from tests.compat.test_node_lock_order import _waiting_for_a_lock_or_done
from tests.factories import UserFactory, api_key_for, make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_resent_delete_racing_the_first_is_a_success_not_a_409():
    renter = UserFactory()
    instance = run(book(renter, make_listed_node(gpu_count=1)))
    assert instance_interrupt(instance_id=instance.pk, since=None, cause=InterruptionCause.NODE_LOST, detail="x")
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(renter)}")
    destroyed, go, answers = threading.Event(), threading.Event(), {}

    def first():
        try:
            with transaction.atomic():
                svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
                destroyed.set()
                go.wait(10)
        finally:
            connection.close()

    def resent():
        try:
            answers["resent"] = client.delete(f"/compat/vast/api/v0/instances/{instance.pk}/")
        finally:
            connection.close()

    a, b = threading.Thread(target=first), threading.Thread(target=resent)
    a.start()
    assert destroyed.wait(10)
    b.start()
    _waiting_for_a_lock_or_done(b)
    go.set()
    a.join(20)
    b.join(20)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYED
    r = answers["resent"]
    assert r.status_code == 200 and r.json() == {"success": True}, (r.status_code, r.content)


def test_a_resent_stop_racing_the_first_stops_failure_is_a_success_not_a_409():
    """The same for `stop instance`: the resend reads the instance running, waits for its row while the first
    sending's stop commits and the stop ends `failed` (its VM gone), and then finds it where the stop was going."""
    renter = UserFactory()
    instance = run(book(renter, make_listed_node(gpu_count=1)))
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(renter)}")
    stopped, go, answers = threading.Event(), threading.Event(), {}

    def first():
        try:
            with transaction.atomic():
                svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
                svc.instance_mark_failed(instance_id=instance.pk, message="its VM vanished during the stop")
                stopped.set()
                go.wait(10)
        finally:
            connection.close()

    def resent():
        try:
            answers["resent"] = client.put(f"/compat/vast/api/v0/instances/{instance.pk}/", {"state": "stopped"},
                                           format="json")
        finally:
            connection.close()

    a, b = threading.Thread(target=first), threading.Thread(target=resent)
    a.start()
    assert stopped.wait(10)
    b.start()
    _waiting_for_a_lock_or_done(b)
    go.set()
    a.join(20)
    b.join(20)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.FAILED
    r = answers["resent"]
    assert r.status_code == 200 and r.json() == {"success": True}, (r.status_code, r.content)
