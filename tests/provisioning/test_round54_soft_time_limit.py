"""Review r54 (ops, LOW-3): jobs_reap, nodes_verify_pending and nodes_reverify_due caught Celery's soft time limit
(SoftTimeLimitExceeded is an Exception) in their per-row `except Exception`: logged as one row's error, the loop
went on until the hard limit killed the pool process, and the two singletons' locks stayed held for their ttl (the
next ticks skipped). Now each re-raises it, as provisioning.services.fleet does, and the singleton is let go."""
from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.utils import timezone

from marketplace.models import NodeState, Verdict
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services import maintenance
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def _time_up(*args, **kwargs):
    raise SoftTimeLimitExceeded()


def test_jobs_reap_stops_at_its_soft_time_limit(monkeypatch):
    past = timezone.now() - timedelta(hours=1)
    Job.objects.create(node=make_node(), kind=JobKind.NODE_VERIFY, status=JobStatus.QUEUED, deadline=past)
    monkeypatch.setattr(maintenance, "_job_reap", _time_up)
    with pytest.raises(SoftTimeLimitExceeded):
        maintenance.jobs_reap()


def test_nodes_verify_pending_stops_at_its_soft_time_limit_and_lets_its_lock_go(monkeypatch):
    make_node(state=NodeState.PENDING)
    monkeypatch.setattr(maintenance, "_node_verify_retry", _time_up)
    with pytest.raises(SoftTimeLimitExceeded):
        maintenance.nodes_verify_pending()
    monkeypatch.setattr(maintenance, "_node_verify_retry", lambda node, now: "waiting")
    assert "skipped" not in maintenance.nodes_verify_pending()


def test_nodes_reverify_due_stops_at_its_soft_time_limit_and_lets_its_lock_go(monkeypatch):
    make_node(state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)  # no drawn time yet: due
    monkeypatch.setattr(maintenance, "_node_recheck", _time_up)
    with pytest.raises(SoftTimeLimitExceeded):
        maintenance.nodes_reverify_due()
    monkeypatch.setattr(maintenance, "_node_recheck", lambda node, now: "waiting")
    assert "skipped" not in maintenance.nodes_reverify_due()
