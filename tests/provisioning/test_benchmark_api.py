"""`GET /api/v1/nodes/{id}/benchmarks/`: the node's provider and operators see its verification history."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import NodeState
from provisioning.models import VerificationRun
from tests.factories import make_node


@pytest.fixture
def node(api):
    node = make_node(api.user, state=NodeState.ACTIVE, verdict="degraded")
    now = timezone.now()
    for n, verdict in enumerate(["verified", "verified", "degraded"]):
        findings = [] if verdict == "verified" else [
            {"severity": "degrade", "code": "power_capped", "message": "GPU 2's power limit is 250 W ...",
             "gpu_index": 2}]
        VerificationRun.objects.create(node=node, verdict=verdict, findings=findings, score=85.0 - n,
                                       figures={"mode": "simulated", "gpus": [{"index": 0, "bf16_tflops": 270.1}]},
                                       created_at=now - timedelta(days=14 - 7 * n))
    return node


def test_the_provider_sees_every_run_newest_first(api, node):
    r = api.get(f"/api/v1/nodes/{node.pk}/benchmarks/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["count"] == 3
    newest = body["results"][0]
    assert (newest["verdict"], newest["score"]) == ("degraded", 83.0)
    assert newest["findings"] == [{"severity": "degrade", "code": "power_capped",
                                   "message": "GPU 2's power limit is 250 W ...", "gpu_index": 2}]
    assert newest["figures"]["gpus"][0]["bf16_tflops"] == 270.1
    assert [run["verdict"] for run in body["results"]] == ["degraded", "verified", "verified"]
    assert set(newest) == {"id", "created_at", "verdict", "score", "findings", "platform_checks", "figures",
                           "job_id"}
    assert newest["platform_checks"] is None  # these runs had no challenge


def test_the_platforms_own_checks_are_summarised_beside_the_figures(api):
    node = make_node(api.user, gpu_count=2, state=NodeState.REJECTED, verdict="rejected")
    challenge = {"gpus": {"0": {"platform_elapsed_s": 4.12, "bf16_tflops": 127.3, "of_datasheet": 0.408,
                                "correct": True}, "1": {"node_elapsed_s": None}},
                 "memory_proof": {"nominal_bytes": 81604378624, "read_deadline_s": 0.1763, "gpus": {
                     "0": {"fresh_s": 1.574, "correct": True}}}}
    VerificationRun.objects.create(node=node, verdict="rejected", findings=[], score=0.0,
                                   figures={"gpus": [], "challenge": challenge})
    checks = api.get(f"/api/v1/nodes/{node.pk}/benchmarks/").json()["results"][0]["platform_checks"]
    assert checks == {
        "gpus": [{"device": "GPU 0", "challenge_tflops": 127.3, "challenge_share": 0.408, "challenge_s": 4.12,
                  "challenge_correct": True, "memory_s": 1.574, "memory_held": "late"},
                 {"device": "GPU 1", "challenge_tflops": None, "challenge_share": None, "challenge_s": None,
                  "challenge_correct": None, "memory_s": None, "memory_held": None}],
        "memory_gib": 76.0, "memory_deadline_s": 0.1763, "memory_not_run": ""}


def test_history_is_paginated(api, node):
    body = api.get(f"/api/v1/nodes/{node.pk}/benchmarks/?page_size=2").json()
    assert (body["count"], len(body["results"])) == (3, 2) and body["next"]
    assert len(api.get(body["next"]).json()["results"]) == 1


def test_operators_see_any_node(operator_api, node):
    assert operator_api.get(f"/api/v1/nodes/{node.pk}/benchmarks/").json()["count"] == 3


@pytest.mark.parametrize("path", ["{pk}", "999999", "abc", "1.5", "99999999999999999999999",
                                  "%C2%B2", "%D9%A3"])  # "²" and "٣": isdigit, but not int()
def test_anyone_else_gets_a_404(other_api, node, path):
    r = other_api.get(f"/api/v1/nodes/{path.format(pk=node.pk)}/benchmarks/")
    assert r.status_code == 404 and "detail" in r.json()


def test_the_providers_own_odd_ids_are_a_404_too(api):
    assert api.get("/api/v1/nodes/%C2%B2/benchmarks/").status_code == 404


def test_an_unknown_query_parameter_is_a_400(api, node):
    r = api.get(f"/api/v1/nodes/{node.pk}/benchmarks/?verdict=ok")
    assert r.status_code == 400 and r.json() == {"verdict": ["Unknown query parameter."]}


def test_anonymous_callers_must_authenticate(anon, node):
    assert anon.get(f"/api/v1/nodes/{node.pk}/benchmarks/").status_code == 401
