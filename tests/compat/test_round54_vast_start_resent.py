"""`vastai start instance` on an instance already on its way to running (review r54): `show instance` says its
intended_status is "running" (booting, starting, interrupted: it resumes by itself), so Vast's declarative PUT of
state=running has nothing to do: a success. It was a 409 for a booting or interrupted one and the CLI reported a
failure, although the stop side already answered its resent stop as a success (STOP_DONE)."""
import pytest

from marketplace.models import Instance, InterruptionCause
from marketplace.services import instances as svc
from marketplace.services.instances.interruptions import instance_interrupt
from tests.compat.test_api import V0, msg
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db


def put_running(api, instance):
    return api.put(f"{V0}/instances/{instance.pk}/", {"state": "running", "label": "kept"}, format="json")


def test_start_of_a_booting_instance_is_a_success_and_changes_nothing_else(api):
    instance = book(api.user, make_listed_node(gpu_count=1))
    for step in (None, svc.instance_mark_provisioning):
        if step:
            step(instance_id=instance.pk)
        before = Instance.objects.get(pk=instance.pk).status
        assert api.get(f"{V0}/instances/{instance.pk}/").json()["instances"]["intended_status"] == "running"
        r = put_running(api, instance)
        assert r.status_code == 200 and r.json() == {"success": True}, r.json()
        after = Instance.objects.get(pk=instance.pk)
        assert (after.status, after.label) == (before, "kept")


def test_start_of_an_interrupted_instance_is_a_success(api):
    instance = run(book(api.user, make_listed_node(gpu_count=1)))
    assert instance_interrupt(instance_id=instance.pk, since=None, cause=InterruptionCause.NODE_LOST, detail="x")
    r = put_running(api, instance)
    assert r.status_code == 200, r.json()
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"


def test_start_of_a_failed_instance_is_still_refused(api):
    instance = run(book(api.user, make_listed_node(gpu_count=1)))
    svc.instance_mark_failed(instance_id=instance.pk, message="broken")
    r = put_running(api, instance)
    assert r.status_code == 409 and msg(r)
    assert Instance.objects.get(pk=instance.pk).label != "kept"
