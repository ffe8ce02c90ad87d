"""A record's history on its admin page is bounded: the latest rows, read-only, with no form field, and a link to
the filtered list of all of them. Found by review: a node's page rendered every event and verification run the node
ever had (Django's inlines show every related row; max_num bounds only new ones), 3,000 events gave 3,000 rows, and
from about 490 events the page could no longer be saved (each row's hidden inputs passed
DATA_UPLOAD_MAX_NUMBER_FIELDS). An instance's interruptions and GPU allocations (one more set at each start) had the
same inlines."""
import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission
from django.utils import timezone

from core.admin_history import LIMIT
from marketplace.models import GpuAllocation, Interruption, User
from provisioning.models import NodeEvent, VerificationRun
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops(operator):
    return logged_in(operator)


def fields_of(page: str) -> list[str]:
    return re.findall(r'<(?:input|select|textarea)[^>]*name="([^"]+)"', page)


def flappy_node(events: int, runs: int = 0):
    node = make_listed_node(UserFactory(), name="flappy", gpu_count=1)
    start = timezone.now() - timedelta(days=30)
    NodeEvent.objects.bulk_create([NodeEvent(node=node, kind="offline" if i % 2 else "back_online",
                                             message=f"flap-marker-{i}.", created_at=start + timedelta(minutes=i))
                                   for i in range(events)])
    VerificationRun.objects.bulk_create([VerificationRun(node=node, verdict="verified", score=i, findings=[],
                                                         figures={}, created_at=start + timedelta(hours=i))
                                         for i in range(runs)])
    return node


def test_a_nodes_page_shows_its_latest_events_and_runs_only_with_a_link_to_all(ops):
    node = flappy_node(events=3000, runs=LIMIT + 5)
    page = ops.get(f"/admin/marketplace/node/{node.pk}/change/").content.decode()
    assert page.count("flap-marker-") == LIMIT
    assert "flap-marker-2999." in page and f"flap-marker-{2999 - LIMIT}." not in page  # the latest, newest first
    assert page.index("flap-marker-2999.") < page.index("flap-marker-2998.")
    assert f'href="/admin/provisioning/nodeevent/?node__id__exact={node.pk}"' in page
    assert f'href="/admin/provisioning/verificationrun/?node__id__exact={node.pk}"' in page
    assert "The latest 20 of 3000" in page and f"The latest 20 of {LIMIT + 5}" in page
    # The link lists that node's events, all of them (the admin accepts the filter).
    listed = ops.get(f"/admin/provisioning/nodeevent/?node__id__exact={node.pk}")
    assert listed.status_code == 200 and "3000 node events" in listed.content.decode()


def test_history_rows_carry_no_form_field_and_the_page_is_still_saved(ops):
    node = flappy_node(events=1200, runs=50)
    url = f"/admin/marketplace/node/{node.pk}/change/"
    page = ops.get(url).content.decode()
    names = fields_of(page)
    assert not [n for n in names if "event" in n or "verification" in n], "history rows carry form fields"
    assert len(names) < 50 and len(names) <= settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
    assert ops.post(url, change_form(ops, url, "node_form")).status_code == 302  # saved (its GPUs' statuses)


def test_a_short_history_is_shown_whole_without_a_count():
    node = flappy_node(events=3, runs=1)
    page = logged_in(UserFactory(is_staff=True, is_superuser=True)).get(
        f"/admin/marketplace/node/{node.pk}/change/").content.decode()
    assert page.count("flap-marker-") == 3 and "The latest" not in page


def staff(*perms: str) -> User:
    user = UserFactory(is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))
    return User.objects.get(pk=user.pk)


def test_each_history_is_shown_to_the_holders_of_its_view_permission(ops):
    """As the inlines were: a staff account that may view nodes but not their events does not read the events."""
    node = flappy_node(events=3, runs=1)
    url = f"/admin/marketplace/node/{node.pk}/change/"
    page = logged_in(staff("marketplace.view_node")).get(url).content.decode()
    assert "flap-marker-" not in page and "verification runs" not in page.lower()
    page = logged_in(staff("marketplace.view_node", "provisioning.view_nodeevent")).get(url).content.decode()
    assert page.count("flap-marker-") == 3 and "verification runs" not in page.lower()


def test_an_instances_interruptions_and_allocations_are_bounded(ops):
    renter, node = UserFactory(), make_listed_node(UserFactory(), name="n", gpu_count=1)
    instance = run(book(renter, node))
    gpu = node.gpus.get()
    start = timezone.now() - timedelta(days=60)
    Interruption.objects.bulk_create([Interruption(
        instance=instance, cause="node_lost", detail=f"cut-marker-{i}.", started_at=start + timedelta(hours=i),
        detected_at=start + timedelta(hours=i), ended_at=start + timedelta(hours=i, minutes=5), outcome="resumed")
        for i in range(600)])
    GpuAllocation.objects.bulk_create([GpuAllocation(
        instance=instance, gpu=gpu, allocated_at=start + timedelta(hours=i),
        released_at=start + timedelta(hours=i, minutes=30)) for i in range(600)])
    url = f"/admin/marketplace/instance/{instance.pk}/change/"
    page = ops.get(url).content.decode()
    assert page.count("cut-marker-") == LIMIT and "cut-marker-599." in page
    assert f'href="/admin/marketplace/interruption/?instance__id__exact={instance.pk}"' in page
    assert "The latest 20 of 601" in page  # the 600 past allocations and the live one, newest first
    assert not [n for n in fields_of(page) if "interruption" in n or "allocation" in n]
    listed = ops.get(f"/admin/marketplace/interruption/?instance__id__exact={instance.pk}")
    assert listed.status_code == 200 and "600 interruptions" in listed.content.decode()
