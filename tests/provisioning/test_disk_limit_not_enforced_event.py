"""Review r53 #2: the node's word that a disk it made has no size limit ("disk_limit": "not_enforced" in `vm create`'s
answer, "size_limit": "not_enforced" in `volume create`'s) was dropped: neither operators nor providers learnt that
one renter could fill that node's disk. Now the first such answer of a node records a warning node event
(disk_limit_not_enforced), once per node; an enforced answer records nothing."""
import pytest

from marketplace.services import volumes as volume_svc
from provisioning.models import Job, NodeEvent
from provisioning.services import volumes as volume_jobs
from tests.factories import UserFactory, make_listed_node
from tests.provisioning import test_agent_renter_text as renter_text
from tests.provisioning.test_agent_renter_text import book_and_provision, docker_node  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

INSPECT = 'print(json.dumps({"Cmd": ["/usr/sbin/sshd", "-D"]}))'


def events(node):
    return list(NodeEvent.objects.filter(node=node, kind="disk_limit_not_enforced"))


def test_an_instance_whose_disk_is_not_enforced_is_a_node_event_once(docker_node, monkeypatch, tmp_path):  # noqa: F811
    fake = renter_text.FAKE_DOCKER.replace(
        INSPECT, 'print(json.dumps({"Cmd": ["/usr/sbin/sshd", "-D"], "Volumes": {"/data": {}}}))')
    assert fake != renter_text.FAKE_DOCKER
    (tmp_path / "bin" / "docker").write_text(fake)
    node, instance, job = book_and_provision(monkeypatch, docker_node)
    assert instance.status == "running", (instance.status, job.error)
    (event,) = events(node)
    assert event.level == NodeEvent.Level.WARNING
    assert f"Instance {instance.pk}'s disk" in event.message and "not_enforced" in event.message


def test_an_enforced_disk_records_nothing(docker_node, monkeypatch):  # noqa: F811
    node, instance, job = book_and_provision(monkeypatch, docker_node)
    assert instance.status == "running", (instance.status, job.error)
    assert events(node) == []


class Node:
    """The node's side of `volume create`: its answer as the agent gives it."""

    def __init__(self, size_limit):
        self.size_limit = size_limit

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def agent(self, command, sub=None, request=None, timeout=None):
        assert (command, sub) == ("volume", "create")
        return {"ok": True, "name": request["name"], "size_gb": request["size_gb"], "size_limit": self.size_limit}


def _create_volume(node, monkeypatch, size_limit):
    monkeypatch.setattr(volume_jobs, "node_session", lambda node: Node(size_limit))
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    volume_jobs.volume_create_run(job=Job.objects.get(volume_id=volume.pk))
    volume.refresh_from_db()
    assert volume.state == "available"
    return volume


def test_volumes_without_a_size_limit_are_a_node_event_once(monkeypatch):
    node = make_listed_node(gpu_count=2, runtime="docker")
    _create_volume(node, monkeypatch, "enforced")
    assert events(node) == []
    first = _create_volume(node, monkeypatch, "not_enforced")
    _create_volume(node, monkeypatch, "not_enforced")
    (event,) = events(node)
    assert f"Volume {first.name} (1 GB)" in event.message
