"""A renter's volume deletion the node answers with an error other than its refusal (its engine failed, e.g.
`docker volume rm`), found by review r53: the renter read "its server could not be reached", and operators got only
a log line at every reconcile pass while the volume stayed `deleting`. Now the wording follows the error, and
operators get one `volume_delete_failed` event per volume (as for an orphan volume). The node is a fake session, as
in test_reconcile_pass_guards.py: the simulated agent's delete cannot be made to fail."""
import pytest
from django.utils import timezone

from marketplace.models import Volume, VolumeState
from marketplace.services import volumes as volume_svc
from provisioning.models import Job, JobKind, NodeEvent
from provisioning.services.reconcile import node_reconcile
from provisioning.services.volumes import volume_job_failed
from provisioning.ssh_errors import AgentFailed, NodeUnreachable
from tests.factories import UserFactory, make_listed_node

pytestmark = pytest.mark.django_db
ENGINE_ERROR = {"code": "command_failed", "message": "docker volume rm: device or resource busy"}


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)


class FailingDeleteNode:
    """A node that has the volume and whose engine fails to delete it."""

    def __init__(self, name):
        self.name, self.deletes = name, 0

    def session(self, node, *args, **kwargs):
        fake = self

        class Session:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                if (cmd, sub) == ("vm", "list"):
                    return {"vms": []}
                if (cmd, sub) == ("volume", "list"):
                    return {"volumes": [{"name": fake.name, "size_gb": 1, "used_by": []}]}
                if (cmd, sub) == ("volume", "delete"):
                    fake.deletes += 1
                    raise AgentFailed(ENGINE_ERROR)
                raise AssertionError((cmd, sub))

        return Session()


def _deleting(node) -> Volume:
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    volume = volume_svc.volume_mark_available(volume_id=volume.pk)
    Job.objects.filter(volume=volume).update(status="succeeded", finished_at=timezone.now())
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    return Volume.objects.get(pk=volume.pk)


def test_a_delete_job_the_node_answered_with_an_error_does_not_say_the_server_could_not_be_reached():
    node = make_listed_node(UserFactory(), gpu_count=1)
    volume = _deleting(node)
    volume_job_failed(job=Job.objects.get(volume=volume, kind=JobKind.VOLUME_DELETE), error=AgentFailed(ENGINE_ERROR))
    message = Volume.objects.get(pk=volume.pk).status_message
    assert "could not be reached" not in message and "answered but could not delete it" in message
    assert "device or resource busy" in message

    other = _deleting(node)
    volume_job_failed(job=Job.objects.get(volume=other, kind=JobKind.VOLUME_DELETE),
                      error=NodeUnreachable("connection timed out"))
    assert "could not be reached" in Volume.objects.get(pk=other.pk).status_message


def test_a_deletion_the_node_fails_at_every_pass_is_reported_to_operators_once(monkeypatch):
    node = make_listed_node(UserFactory(), gpu_count=1)
    volume = _deleting(node)
    volume_job_failed(job=Job.objects.get(volume=volume, kind=JobKind.VOLUME_DELETE),
                      error=NodeUnreachable("connection timed out"))
    fake = FailingDeleteNode(volume.name)
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    for _ in range(3):
        node_reconcile(node)
    assert fake.deletes == 3  # tried again at every pass
    events = NodeEvent.objects.filter(node=node, kind="volume_delete_failed")
    assert events.count() == 1 and volume.name in events.get().message
    assert "device or resource busy" in events.get().message
    volume = Volume.objects.get(pk=volume.pk)
    assert volume.state == VolumeState.DELETING and "answered but could not delete it" in volume.status_message
