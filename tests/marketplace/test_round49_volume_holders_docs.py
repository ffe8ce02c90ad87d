"""r49 review: what the API reference says against what it does (volumes' holders, a stopped instance's disk).

docs/openapi.yaml said only an instance "not destroyed or failed" holds a volume, yet a failed instance that ran
(its VM kept on the node) refuses the volume's delete (409); and an instance destroyed while its node could not be
reached (its VM still to be removed) refused the delete too while `in_use_by` was empty. Its first paragraph said a
stopped instance "is not charged at all, disk included", yet its disk is billed per second."""

from pathlib import Path

import pytest
import yaml

from billing.services.storage import storage_meter
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from tests.billing.conftest import clock  # noqa: F401
from tests.billing.helpers import fund, node, running, stop
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db
SCHEMA = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml").read_text())


def _running_with_a_volume(api):
    on = make_listed_node()
    r = api.post("/api/v1/volumes/", {"offer": on.pk, "size_gb": 5}, format="json")
    volume = volume_svc.volume_mark_available(volume_id=r.json()["id"])
    r = api.post(
        "/api/v1/instances/",
        {
            "offer": on.pk,
            "num_gpus": 1,
            "image": "pytorch-2-5",
            "ssh_public_key": ed25519_key(),
            "volumes": [{"volume": volume.pk, "mount": "/data"}],
        },
        format="json",
    )
    return run(svc.Instance.objects.get(pk=r.json()["id"])), volume


def _in_use_by(api, volume):
    shown = api.get(f"/api/v1/volumes/{volume.pk}/").json()["in_use_by"]
    listed = [v["in_use_by"] for v in api.get("/api/v1/volumes/").json()["results"] if v["id"] == volume.pk]
    assert listed == [shown]
    return shown


def test_a_failed_instance_that_ran_holds_its_volume_as_the_docs_say(api, user):
    instance, volume = _running_with_a_volume(api)
    svc.instance_mark_failed(instance_id=instance.pk, message="its container exited")
    refused = api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name}, format="json")
    assert _in_use_by(api, volume) == [instance.pk] and refused.status_code == 409, refused.content
    in_use_by = SCHEMA["components"]["schemas"]["Volume"]["properties"]["in_use_by"]["description"]
    destroy = SCHEMA["paths"]["/api/v1/volumes/{id}/"]["delete"]["description"]
    for text in (" ".join(in_use_by.split()), " ".join(destroy.split())):
        assert "not destroyed or failed" not in text and "failed" in text and "ran" in text, text


def test_an_instance_destroyed_with_its_vm_left_on_the_node_is_in_in_use_by_as_it_blocks_the_delete(api, user):
    instance, volume = _running_with_a_volume(api)
    svc.instance_destroy(instance=instance)
    svc.instance_mark_destroyed(instance_id=instance.pk, cleanup_pending=True)  # the node could not be reached
    refused = api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name}, format="json")
    assert refused.status_code == 409, refused.content
    assert _in_use_by(api, volume) == [instance.pk]

    svc.instance_cleanup_done(instance_id=instance.pk)  # the reconciler removed its VM
    assert _in_use_by(api, volume) == []
    assert api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name}, format="json").status_code == 202


def test_the_api_description_says_a_stopped_instances_disk_is_charged(clock, user, api):  # noqa: F811
    fund(user, "20")
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 300_000
    on.save()
    instance = stop(running(user, on))
    clock.advance(hours=24)
    storage_meter()
    shown = api.get(f"/api/v1/instances/{instance.pk}/").json()
    assert shown["status"] == "stopped" and float(shown["disk_cost_so_far"]) > 0, shown["disk_cost_so_far"]
    description = " ".join(SCHEMA["info"]["description"].split())
    assert "not charged at all, disk included" not in description, description
    assert "keeps its disk, billed per second at its `disk_price_per_gb_month`" in description, description
    assert "everything you pay for" in description and "storage" in description, description
