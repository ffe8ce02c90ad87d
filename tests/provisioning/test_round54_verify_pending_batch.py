"""nodes_verify_pending leaves alone the pending nodes whose automatic retries stopped and were told so (review r54,
onboard #1): before, it walked every pending node by pk each beat, thousands of junk registrations among them,
and pushed newer pending nodes past the task's time limit. It now looks at the others only, the longest waiting
first, PENDING_RETRY_BATCH a beat."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import NodeState
from provisioning import tasks
from provisioning.models import Job, JobKind, NodeEvent
from provisioning.services import maintenance
from provisioning.services.runner import job_begin
from provisioning.services.verification import node_verify_request
from provisioning.ssh_errors import NodeUnreachable
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def _stopped(node, now):
    """Fail the node's automatic retries until they stop, and let the beat tell its provider."""
    for attempt in range(1, maintenance.PENDING_RETRY_MAX_FAILURES + 1):
        reason = f"{maintenance.PENDING_RETRY_REASON} (try {attempt} of {maintenance.PENDING_RETRY_MAX_FAILURES})"
        job = job_begin(job_id=node_verify_request(node=node, reason=reason).pk)
        tasks._fail(job, NodeUnreachable("nothing answers"))
    assert maintenance.nodes_verify_pending(now=now)["stopped"] == 1
    assert NodeEvent.objects.filter(node=node, kind="verification_retries_stopped").exists()


def test_nodes_told_that_their_retries_stopped_are_not_walked_again():
    later = timezone.now() + timedelta(hours=3)
    stopped = make_node(state=NodeState.PENDING)
    _stopped(stopped, later)
    fresh = make_node(state=NodeState.PENDING)
    summary = maintenance.nodes_verify_pending(now=later)
    assert summary["stopped"] == 0, summary
    assert summary["queued"] == 1 and Job.objects.filter(node=fresh, kind=JobKind.NODE_VERIFY).exists()


def test_asking_again_by_hand_brings_a_stopped_node_back():
    later = timezone.now() + timedelta(hours=3)
    node = make_node(state=NodeState.PENDING)
    _stopped(node, later)
    job = job_begin(job_id=node_verify_request(node=node).pk)  # the provider's Verify
    tasks._fail(job, NodeUnreachable("still nothing"))
    summary = maintenance.nodes_verify_pending(now=later + timedelta(hours=3))
    assert summary["queued"] == 1, summary


def test_the_longest_waiting_come_first_within_the_batch(monkeypatch):
    monkeypatch.setattr(maintenance, "PENDING_RETRY_BATCH", 1)
    tried = make_node(state=NodeState.PENDING)  # the lower pk, tried a moment ago: waiting out its backoff
    job = job_begin(job_id=node_verify_request(node=tried).pk)
    tasks._fail(job, NodeUnreachable("nothing answers"))
    never = make_node(state=NodeState.PENDING)  # never tried: due first
    summary = maintenance.nodes_verify_pending(now=timezone.now())
    assert summary == {"queued": 1, "waiting": 0, "stopped": 0, "errors": 0}
    assert Job.objects.filter(node=never, kind=JobKind.NODE_VERIFY).exists()
