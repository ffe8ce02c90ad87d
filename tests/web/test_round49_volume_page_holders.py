"""r49 review: the volumes page showed a volume's holders as the instance rows say (volume_live_instance_ids), so an
instance destroyed while its node could not be reached, whose VM still mounts the volume, was left out: "none" under
"Mounted by" and a delete offered that the service then refused (409). The API's `in_use_by` lists it; the page now
shows the same holders (services.volumes.volume_holder_ids)."""

import pytest

from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


def _mounted_by(page: str) -> str:
    start = page.index('data-label="Mounted by"')
    return page[start : page.index("</td>", start)]


def test_the_page_shows_an_instance_whose_vm_is_still_to_be_removed_as_holding_the_volume(
    web, funded_renter, sent_jobs
):  # noqa: F811
    node = make_listed_node()
    volume = volume_svc.volume_create(owner=funded_renter, node_id=node.pk, size_gb=5)
    volume = volume_svc.volume_mark_available(volume_id=volume.pk)
    instance = run(book(funded_renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}]))
    svc.instance_destroy(instance=instance)
    svc.instance_mark_destroyed(instance_id=instance.pk, cleanup_pending=True)  # the node could not be reached

    page = web.get("/volumes/").content.decode()
    assert f"#{instance.pk}" in _mounted_by(page), _mounted_by(page)
    assert "Destroy its instance to delete it" in page and f"/volumes/{volume.pk}/delete/" not in page
    assert volume_svc.volume_holder_ids(volume) == [instance.pk]  # as its delete is refused

    svc.instance_cleanup_done(instance_id=instance.pk)  # the reconciler removed its VM
    page = web.get("/volumes/").content.decode()
    assert "none" in _mounted_by(page) and f"/volumes/{volume.pk}/delete/" in page
