"""The fleet dashboard counts the failed jobs of each fault: the node's verifications and the platform's jobs, and
now the jobs that met a changed SSH host key their node is quarantined for already (JobFault.HOST_KEY, e3b7c1b).
Neither of the other two counts takes those, so before they were nowhere on the dashboard while the new keys waited
for an operator to accept them."""
from datetime import timedelta

import pytest
from django.utils import timezone

from operations.dashboard import fleet_figures
from provisioning.models import Job, JobFault, JobKind, JobStatus
from tests.factories import UserFactory, make_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _failed(node, fault: str, ago: timedelta = timedelta(minutes=5)) -> Job:
    at = timezone.now() - ago
    return Job.objects.create(node=node, kind=JobKind.NODE_VERIFY, status=JobStatus.FAILED, fault=fault,
                              error="met the changed host key", created_at=at, finished_at=at, deadline=at)


def test_the_dashboard_counts_and_links_the_jobs_failed_on_a_changed_host_key():
    node = make_node()
    _failed(node, JobFault.HOST_KEY)
    _failed(node, JobFault.HOST_KEY)
    _failed(node, JobFault.HOST_KEY, ago=timedelta(days=2))  # past the 24 h, as the other counts
    _failed(node, JobFault.PLATFORM)
    figures = fleet_figures({"jobs"})
    assert figures["host_key_jobs_day"] == 2
    assert figures["platform_failed_jobs_day"] == 1  # each fault its own count
    url = "/admin/provisioning/job/?status__exact=failed&fault__exact=host_key&finished=24h"  # as counted (r54)
    assert figures["host_key_jobs_url"] == url
    ops = logged_in(UserFactory(is_staff=True, is_superuser=True))
    page = ops.get("/admin/").content.decode()
    assert 'id="host-key-jobs">2<' in page and f'href="{url}"' in page.replace("&amp;", "&")
    assert 'id="platform-failed-jobs">1<' in page
    assert ops.get(url).context["cl"].result_count == 2  # the 24 h counted, not the one 2 days old too
