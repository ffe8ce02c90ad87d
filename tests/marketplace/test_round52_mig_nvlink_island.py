"""Review r52 (MIG/ops finding 2): an instance holding MIG slices on two cards of one NVLink island was reported
`gpus_on_one_nvlink_island: true`. MIG slices have no peer-to-peer between them (neither NVLink nor PCIe), and
booking refuses require_nvlink with a mig_profile: the field is null (not applicable) for a MIG instance."""
import pytest
from rest_framework.test import APIClient

from marketplace.models import Node
from marketplace.services import instances as svc
from tests.billing.helpers import fund
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db

ONE_ISLAND = {"connected": True, "islands": [[0, 1]]}


def _on_island(node) -> None:
    Node.objects.filter(pk=node.pk).update(benchmark_summary={"nvlink": ONE_ISLAND})


def test_mig_slices_on_two_cards_of_one_island_are_not_said_to_share_it():
    node = make_mig_node({0: ["7g.80gb"], 1: ["7g.80gb"]}, gpu_count=2, prices={"7g.80gb": "1.00"})
    _on_island(node)
    renter = UserFactory()
    fund(renter, "50")
    inst = run(book(renter, node, num_gpus=2, mig_profile="7g.80gb"))
    client = APIClient()
    client.force_authenticate(renter)
    body = client.get(f"/api/v1/instances/{inst.pk}/").json()
    assert (body["gpus"], body["gpus_on_one_nvlink_island"]) == ([0, 1], None), body
    [row] = [r for r in client.get("/api/v1/instances/").json()["results"] if r["id"] == inst.pk]
    assert row["gpus_on_one_nvlink_island"] is None
    fresh = svc.instances_for_user(user=renter).get(pk=inst.pk)
    assert svc.instance_on_one_nvlink_island(instance=fresh) is None


def test_whole_gpus_of_the_same_island_still_say_true():
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    _on_island(node)
    renter = UserFactory()
    fund(renter, "50")
    inst = run(book(renter, node, num_gpus=2))
    fresh = svc.instances_for_user(user=renter).get(pk=inst.pk)
    assert svc.instance_on_one_nvlink_island(instance=fresh) is True


def test_the_schema_says_null_for_a_mig_instance():
    client = APIClient()
    text = client.get("/api/schema/").content.decode()
    start = text.index("gpus_on_one_nvlink_island:")
    assert "MIG instance" in text[start:start + 600]
