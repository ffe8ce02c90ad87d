"""The benchmark check end to end: API → Celery worker (Redis) → SSH → the agent's benchmark on simulated
servers → policy → verdict, score, offers and the benchmark history."""
import pytest

from marketplace.models import Node, NodeState
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.slow


def _settled(node_id):
    node = Node.objects.get(pk=node_id)
    job = node.jobs.first()
    return node if job and job.status in ("succeeded", "failed") and node.state != NodeState.VERIFYING else None


def test_honest_and_dishonest_servers_through_the_worker(worker, sim_node_factory, api, other_api, anon):
    honest, _ = sim_node_factory(api, profile="rtx-a4000-x2", gpu_model="rtx-a4000", gpu_count=2)
    riser, _ = sim_node_factory(api, profile="rtx-a4000-x2-riser", gpu_model="rtx-a4000", gpu_count=2)
    corrupt, _ = sim_node_factory(api, profile="rtx-a4000-x2-bad-matmul", gpu_model="rtx-a4000", gpu_count=2)
    for node in (honest, riser, corrupt):
        assert api.post(f"/api/v1/nodes/{node.pk}/verify/").status_code == 202
    honest, riser, corrupt = (wait_until(lambda n=n: _settled(n.pk), 60, what=f"node {n.pk}'s verification")
                              for n in (honest, riser, corrupt))
    assert (honest.state, honest.verdict) == ("active", "verified"), (honest.last_error, worker.tail())
    assert (riser.state, riser.verdict) == ("active", "degraded")
    assert (corrupt.state, corrupt.verdict) == ("rejected", "rejected")
    assert "wrong matrix products" in corrupt.last_error and "take it out of service" in corrupt.last_error

    # Offers: the degraded node is listed, flagged and scored lower; the rejected one is not listed.
    offers = {o["id"]: o for o in anon.get("/api/v1/offers/?gpu_model=rtx-a4000").json()["results"]}
    assert set(offers) == {honest.pk, riser.pk}
    assert offers[honest.pk]["verified"] is True and offers[riser.pk]["verified"] is False
    assert 0 < offers[riser.pk]["score"] < offers[honest.pk]["score"]
    assert offers[honest.pk]["score_per_dollar"] > offers[riser.pk]["score_per_dollar"]

    # The history: figures, verdict and reasons for the provider; a 404 for anyone else.
    runs = api.get(f"/api/v1/nodes/{riser.pk}/benchmarks/").json()["results"]
    assert runs[0]["verdict"] == "degraded"
    assert {(f["code"], f["gpu_index"]) for f in runs[0]["findings"]} == {("pcie_width", 1), ("host_link_slow", 1)}
    gpus = runs[0]["figures"]["gpus"]
    assert gpus[1]["h2d_gbs"] < 10 < gpus[0]["h2d_gbs"] and gpus[0]["bf16_tflops"] > 40
    assert other_api.get(f"/api/v1/nodes/{riser.pk}/benchmarks/").status_code == 404
