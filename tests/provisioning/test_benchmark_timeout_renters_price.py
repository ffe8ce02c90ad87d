"""A re-check whose benchmark hangs (BenchmarkTimeout) rejects the node (verification_failed: it takes no new
rental), but its renters' price is not cut. A re-check benchmarks the free cards only, never a rented one, so a
hang says nothing of the cards renters hold, which go on working for them. Before, the rejection's finding, about the
whole server, cut every renter of the node to $0/h until a later check passed, as a card fallen off the bus once did
(NOT_ABOUT_RENTERS). A failure of the node's agent itself (garbage, refusing the platform's key) still concerns all."""
import pytest

from marketplace.models import Node, NodeState, Verdict
from provisioning.services.runner import job_begin
from provisioning.services.verification import BenchmarkTimeout, node_verify_failed, node_verify_request
from provisioning.ssh_errors import AgentGarbage
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db


def _rented_node_fails(error):
    node = make_listed_node(gpu_count=2)
    instance = run(book(UserFactory(), node))
    price = instance.price_per_hour_micros
    assert price > 0
    job = job_begin(job_id=node_verify_request(node=node).pk)
    node_verify_failed(job=job, error=error)
    node = Node.objects.get(pk=node.pk)
    instance.refresh_from_db()
    assert (node.state, node.verdict) == (NodeState.ACTIVE, Verdict.REJECTED)  # up for its renter, off the offers
    assert node.verifications.get().findings[0]["code"] == "verification_failed"
    return price, instance


def test_a_hung_benchmark_rejects_the_node_without_cutting_its_renters_price(sent_jobs):
    price, instance = _rented_node_fails(BenchmarkTimeout("The benchmark did not answer within 960 s."))
    assert instance.price_per_hour_micros == price
    assert instance.status == "running"


def test_an_agent_answering_garbage_still_concerns_every_renter(sent_jobs):
    price, instance = _rented_node_fails(AgentGarbage("The agent's answer is not JSON."))
    assert instance.price_per_hour_micros == 0
