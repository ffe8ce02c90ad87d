"""A node that missed its last health check (`health_failures`) is neither offered nor booked (models.nodes.ANSWERING,
offer_rules.node_refusal), in the words the start of a stopped instance uses for it. Found by review against
PostgreSQL: such a node, its renters already interrupted, stayed on the offers and took bookings, while the start
of a stopped instance on it was refused."""
import pytest

from marketplace.models import Node
from marketplace.models.nodes import offerable
from marketplace.selectors import node_not_offered_reason
from tests.factories import UserFactory, make_listed_node

from .renting_helpers import book, ed25519_key, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db


def offered(anon, node) -> bool:
    return node.pk in [o["id"] for o in anon.get("/api/v1/offers/").json()["results"]]


@pytest.mark.parametrize("failures", [1, 2])  # 2: NODE_INTERRUPT_AFTER_FAILED_CHECKS, its renters interrupted
def test_a_node_that_missed_its_last_health_check_is_not_offered_nor_booked(anon, api, failures):
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    assert offered(anon, node)
    Node.objects.filter(pk=node.pk).update(health_failures=failures)
    node.refresh_from_db()
    assert not offered(anon, node)
    assert not Node.objects.filter(offerable(), pk=node.pk).exists()
    assert node_not_offered_reason(node) == "it did not answer its last health check"
    before = snapshot(node)
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                        "ssh_public_key": ed25519_key()}, format="json")
    assert r.status_code == 409, r.content
    assert r.json()["detail"] == f"Offer {node.pk} is not available: its node did not answer its last health check."
    assert snapshot(node) == before
    Node.objects.filter(pk=node.pk).update(health_failures=0)  # it answers again
    assert offered(anon, node)
    assert book(UserFactory(), node).status == "requested"
