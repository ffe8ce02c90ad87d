"""Review r54 (ops, LOW-1): the dashboard's "Critical events (7 days)" had no usable index (NodeEvent had only its
node's), so the never-pruned node-events table was read in full on each admin front page; the "failed in 24 h" job
counts read every failed job ever made through job_open_deadline_idx. Each query now has an index (PostgreSQL's plan
with sequential scans turned off)."""
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Q
from django.utils import timezone

from operations.dashboard import CRITICAL_KINDS
from provisioning.models import Job, JobFault, JobStatus, NodeEvent
from tests.factories import make_node

pytestmark = [pytest.mark.django_db,
              pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's plans")]


def _plan(qs) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_sort = off")
    return qs.explain()


def test_critical_events_query_has_an_index():
    node = make_node()
    NodeEvent.objects.create(node=node, level=NodeEvent.Level.CRITICAL, kind="offline", message="gone")
    qs = NodeEvent.objects.filter(Q(level=NodeEvent.Level.CRITICAL) | Q(kind__in=CRITICAL_KINDS),
                                  created_at__gte=timezone.now() - timedelta(days=7))[:10]
    assert "Seq Scan on provisioning_nodeevent" not in _plan(qs)


def test_a_nodes_events_newest_first_have_an_index():
    node = make_node()
    qs = NodeEvent.objects.filter(node=node).order_by("-created_at", "-id")[:50]
    assert "nodeevent_node_recent_idx" in _plan(qs)  # the node's rows read in order: no sort


def test_failed_jobs_in_24_hours_use_the_partial_index():
    qs = Job.objects.filter(status=JobStatus.FAILED, fault=JobFault.NODE,
                            finished_at__gte=timezone.now() - timedelta(days=1))
    assert "job_failed_finished_idx" in _plan(qs)
