"""A volume deleted while its node is quarantined (its SSH host key changed: neither a check nor a job talks to it
until an operator accepts the new key).

Before: the delete (202, `deleting`, billing closed) queued a VOLUME_DELETE job, which met the changed key at once
(HostKeyMismatch, not retried): the job failed with fault=node (held against the provider's reliability), the node
was quarantined again (another critical host_key_changed event for the operators), and the volume stayed `deleting`
"its server could not be reached", to be finished by the reconciler once the node answers. Now the deletion is taken
the same way without the job, as an instance's destroy there ends at once: the renter's side ends now (billing
closed at the node's last healthy moment), the status says why, and the node's reconcile after the key is accepted
deletes it there.

Real parts: a simulated server over real SSH whose host key really changes (round47_quarantine_sim), the fleet's
health check that meets the new key, the API, the job as a worker delivery runs it, the reconciler, PostgreSQL."""
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Volume, VolumeState
from provisioning import tasks
from provisioning.models import OPEN, Job, JobKind
from provisioning.services.maintenance import nodes_health_check
from provisioning.services.reconcile import node_reconcile
from tests.marketplace.sim_renting import deliver, sent_jobs_fixture  # noqa: F401 (fixture)

from .round47_quarantine_sim import funded_renter, jobs_held_against, qnode_fixture, simbase_fixture  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/volumes/"


def _available_volume(client, node) -> Volume:
    answer = client.post(URL, {"offer": node.pk, "size_gb": 1}, format="json")
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(volume_id=answer.json()["id"], kind=JobKind.VOLUME_CREATE)
    deliver(tasks.volume_create, job)
    volume = Volume.objects.get(pk=answer.json()["id"])
    assert volume.state == VolumeState.AVAILABLE, volume.status_message
    return volume


def _on_node(qnode, volume) -> bool:
    return volume.name in {v["name"] for v in qnode.agent("volume", "list")["volumes"]}


def _run_open_delete_jobs() -> None:
    for job in Job.objects.filter(OPEN, kind=JobKind.VOLUME_DELETE).order_by("pk"):
        deliver(tasks.volume_delete, job)


def test_a_volume_deleted_on_a_quarantined_node_ends_at_once_and_is_deleted_there_once_the_key_is_accepted(
        qnode, client_for):
    renter = funded_renter()
    client = client_for(renter)
    volume = _available_volume(client, qnode.node)
    assert _on_node(qnode, volume)
    # Available for ten minutes, seen by a health check (its last healthy moment), then its key changes.
    Volume.objects.filter(pk=volume.pk).update(available_at=timezone.now() - timedelta(minutes=10))
    assert nodes_health_check()["failed"] == 0
    time.sleep(1.5)
    node = qnode.quarantined_by_a_health_check()
    events, held = qnode.critical_events(), jobs_held_against(node)

    answer = client.delete(f"{URL}{volume.pk}/", {"confirm": volume.name}, format="json")
    assert answer.status_code == 202, answer.content
    body = answer.json()
    assert body["state"] == VolumeState.DELETING
    assert "host key" in body["status_message"] and "could not be reached" not in body["status_message"], body
    _run_open_delete_jobs()  # the old code's delete job, run as a worker would

    volume.refresh_from_db()
    assert volume.state == VolumeState.DELETING, volume.status_message
    assert not Job.objects.filter(volume=volume, kind=JobKind.VOLUME_DELETE).exists()
    assert jobs_held_against(node) == held and qnode.critical_events() == events
    # Billed up to the node's last healthy moment (the platform saw nothing after it), not up to the request.
    assert volume.billed_until is not None and volume.billed_until <= node.last_seen_at
    assert volume.billed_seconds >= 599

    # The key is accepted and the node verified again: its reconcile deletes the volume there; nothing more is
    # charged (billing.services.storage.node_storage_outage_end moves a deleting volume's billed_until on, uncharged,
    # for a refusal by the node to be billed from then).
    charged = (volume.billed_seconds, volume.cost_micros)
    node = qnode.accepted_and_verified()
    counts = node_reconcile(node)
    volume.refresh_from_db()
    assert counts["volumes_deleted"] == 1 and volume.state == VolumeState.DELETED, volume.status_message
    assert not _on_node(qnode, volume)
    assert (volume.billed_seconds, volume.cost_micros) == charged


def test_a_volume_deleted_on_a_reachable_node_still_sends_its_job(qnode, client_for):
    client = client_for(funded_renter())
    volume = _available_volume(client, qnode.node)
    answer = client.delete(f"{URL}{volume.pk}/", {"confirm": volume.name}, format="json")
    assert answer.status_code == 202, answer.content
    _run_open_delete_jobs()
    volume.refresh_from_db()
    assert volume.state == VolumeState.DELETED and not _on_node(qnode, volume)
