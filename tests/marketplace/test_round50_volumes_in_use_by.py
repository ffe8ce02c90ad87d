"""r50 cleanup: the API's `in_use_by` is services.volumes.volume_holder_ids (what the web page lists and what
refuses the delete), for a volume shown alone and in the list, with no query more (tests/test_query_counts.py)."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from marketplace.models import Volume
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from tests.marketplace.renting_helpers import sent_jobs_fixture  # noqa: F401
from tests.marketplace.test_round49_volume_holders_docs import _in_use_by, _running_with_a_volume

pytestmark = pytest.mark.django_db
QUERIES_SHOWN, QUERIES_LISTED = 4, 5


def _holders(volume) -> list[int]:
    return volume_svc.volume_holder_ids(Volume.objects.prefetch_related("mounts__instance").get(pk=volume.pk))


def test_in_use_by_is_the_services_holders_in_every_state(api, user):
    instance, volume = _running_with_a_volume(api)
    assert _in_use_by(api, volume) == _holders(volume) == [instance.pk]  # live
    svc.instance_destroy(instance=instance)
    svc.instance_mark_destroyed(instance_id=instance.pk, cleanup_pending=True)  # its VM still on the node
    assert _in_use_by(api, volume) == _holders(volume) == [instance.pk]
    svc.instance_cleanup_done(instance_id=instance.pk)
    assert _in_use_by(api, volume) == _holders(volume) == []


def test_a_volume_shown_alone_and_listed_costs_the_queries_it_did(api, user):
    """Measured on the code before this change: 4 queries to show one volume, 5 to list them (the list reads the
    page's nodes' leaving instances once, in the viewset; one volume shown alone reads its node's)."""
    _, volume = _running_with_a_volume(api)
    for url, most in ((f"/api/v1/volumes/{volume.pk}/", QUERIES_SHOWN), ("/api/v1/volumes/", QUERIES_LISTED)):
        with CaptureQueriesContext(connection) as queries:
            assert api.get(url).status_code == 200
        assert len(queries.captured_queries) <= most, (url, [q["sql"][:120] for q in queries.captured_queries])
