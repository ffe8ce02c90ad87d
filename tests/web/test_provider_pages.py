"""Providers' pages: register a server, the list, a server's page with its history, and its switches."""
import re

import pytest
from django.test import Client
from django.utils import timezone

from marketplace.models import Node, NodeState, Verdict
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_private_key
from provisioning.models import Job, VerificationRun
from tests.factories import make_listed_node, make_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

REGISTER = {
    "name": "rack1-a6000", "address": "LocalHost", "ssh_port": "2222", "ssh_user": "gpumarket",
    "host_key_fingerprint": "", "country": "DE", "city": "Frankfurt", "datacenter": "FRA1",
    "gpu_model": "rtx-a6000", "gpu_count": "8", "price_per_gpu_hour": "0.79", "runtime": "docker",
}

FINDINGS = [
    {"severity": "reject", "code": "sm_count", "gpu_index": 0,
     "message": "GPU 0 has 84 streaming multiprocessors; a A100 80GB SXM has 108."},
    {"severity": "reject", "code": "bf16_low", "gpu_index": 1,
     "message": "GPU 1 reaches 135 TFLOP/s in BF16 matmul, 43% of the 312 a A100 80GB SXM is rated for."},
]
FIGURES = {
    "datasheet": {"bf16_tflops": 312.0, "fp16_tflops": 312.0, "tf32_tflops": 156.0, "fp32_tflops": 19.5,
                  "memory_bandwidth_gbs": 2039.0},
    "median": {"bf16_tflops": 135.0, "memory_bandwidth_gbs": 690.0},
    "gpus": [
        {"index": i, "bf16_tflops": 135.0, "fp16_tflops": 135.0, "tf32_tflops": 68.0, "fp32_tflops": 33.0,
         "memory_bandwidth_gbs": 690.0, "score": 0.0,
         "of_datasheet": {"bf16_tflops": 0.433, "fp16_tflops": 0.433, "tf32_tflops": 0.436, "fp32_tflops": 1.69,
                          "memory_bandwidth_gbs": 0.338}}
        for i in range(2)
    ],
    # What the platform measured itself (challenge_verdict.judge, memproof_verdict.judge): an A6000's speed, its
    # memory held
    "challenge": {
        "gpus": {str(i): {"platform_elapsed_s": 4.12, "bf16_tflops": 127.3, "of_datasheet": 0.408, "correct": True}
                 for i in range(2)},
        "memory_proof": {"nominal_bytes": 81604378624, "read_deadline_s": 0.1763, "fill_wait_s": 565.3,
                         "gpus": {str(i): {"fresh_s": 0.0972, "correct": True, "fill_s": 0.61} for i in range(2)}},
    },
}


@pytest.fixture
def provider(renter):
    return renter


@pytest.fixture
def own_node(provider):
    return make_node(provider, name="mine", gpu_model="a100-80gb-sxm", gpu_count=2)


@pytest.fixture
def rejected_node(provider):
    node = make_node(provider, name="fake-a100", gpu_model="a100-80gb-sxm", gpu_count=2,
                     state=NodeState.REJECTED, verdict=Verdict.REJECTED)
    VerificationRun.objects.create(node=node, verdict="rejected", findings=FINDINGS, figures=FIGURES, score=0.0)
    return node


def test_register_a_server_then_see_the_install_command(web, provider):
    r = web.post("/nodes/new/", REGISTER)
    node = Node.objects.get(provider=provider)
    assert r.status_code == 302 and r["Location"] == f"/nodes/{node.pk}/"
    assert node.address == "localhost" and node.gpu_count == 8 and node.price_per_gpu_hour_micros == 790000
    page = web.get(r["Location"]).content.decode()
    assert "Install the platform's key" in page and node.ssh_public_key in page and "authorized_keys" in page
    assert "Verify now" in page


def test_the_register_page_offers_the_sim_runtime_only_where_the_platform_takes_it(web, provider, settings):
    settings.SIM_NODES_ALLOWED = False
    page = web.get("/nodes/new/").content.decode()
    assert 'value="docker"' in page and 'value="sim"' not in page
    r = web.post("/nodes/new/", {**REGISTER, "runtime": "sim"})
    assert r.status_code == 400 and 'id="id_runtime_errors"' in r.content.decode() and not Node.objects.exists()
    settings.SIM_NODES_ALLOWED = True
    assert 'value="sim"' in web.get("/nodes/new/").content.decode()


def test_register_errors_show_next_to_the_fields_and_keep_the_input(web, provider):
    bad = {**REGISTER, "address": "not a host!", "ssh_user": "Root", "price_per_gpu_hour": "500",
           "host_key_fingerprint": "MD5:aa"}
    r = web.post("/nodes/new/", bad)
    page = r.content.decode()
    assert r.status_code == 400 and not Node.objects.exists()
    for name in ("address", "ssh_user", "price_per_gpu_hour", "host_key_fingerprint"):
        assert f'id="id_{name}_errors"' in page, name
    assert 'value="not a host!"' in page and 'value="rack1-a6000"' in page and 'value="Frankfurt"' in page
    assert re.search(r'<option value="rtx-a6000" selected', page)


def test_register_the_same_address_twice_is_explained(web, provider):
    web.post("/nodes/new/", REGISTER)
    r = web.post("/nodes/new/", {**REGISTER, "name": "again"})
    assert r.status_code == 400 and "already registered at localhost:2222" in r.content.decode()


def test_register_needs_csrf(csrf_web):
    assert csrf_web.post("/nodes/new/", REGISTER).status_code == 403
    assert not Node.objects.exists()


def test_nodes_list_shows_mine_with_utilisation(web, provider, stranger, own_node):
    theirs = make_node(stranger, name="theirs")
    listed = make_listed_node(provider, name="busy", gpu_model="rtx-a4000", gpu_count=4)
    book(stranger, listed, num_gpus=3)
    page = web.get("/nodes/").content.decode()
    assert f'href="/nodes/{own_node.pk}/"' in page and f'href="/nodes/{theirs.pk}/"' not in page
    assert "3 / 4" in page and "0 / 2" in page


def test_operators_see_only_their_own_servers_on_these_pages(operator, stranger):
    theirs = make_node(stranger, name="theirs")
    ops = logged_in(operator)
    assert f"/nodes/{theirs.pk}/" not in ops.get("/nodes/").content.decode()
    assert ops.get(f"/nodes/{theirs.pk}/").status_code == 404


def test_another_users_server_is_a_404_everywhere(stranger, own_node):
    other = logged_in(stranger)
    assert other.get(f"/nodes/{own_node.pk}/").status_code == 404
    assert other.get(f"/nodes/{own_node.pk}/live/").status_code == 404
    for action in ("verify", "settings", "retire"):
        assert other.post(f"/nodes/{own_node.pk}/{action}/", {"price_per_gpu_hour": "9"}).status_code == 404
    own_node.refresh_from_db()
    assert own_node.state == NodeState.PENDING and not Job.objects.exists()


def test_node_page_shows_reasons_chart_and_history_but_no_secret(web, rejected_node):
    r = web.get(f"/nodes/{rejected_node.pk}/")
    page = r.content.decode()
    assert "Why it was rejected" in page
    assert "84 streaming multiprocessors" in page and "(sm_count)" in page and "(bf16_low)" in page
    assert "an A100 80GB SXM has 108" in page and "a A100" not in page
    # What the figures do fit (FIGURES: 135 TFLOP/s BF16 and 690 GB/s): not the A100 declared.
    assert 'id="closest-model">The measured figures fit an RTX A6000 best, not the model declared' in page
    assert "sm_count (GPU 0), bf16_low (GPU 1)" in page  # the history's reasons
    assert page.count("<svg") == 2 and "Measured as a share of the datasheet, per GPU" in page
    assert "Benchmark history" in page and "43%" in page
    private = node_private_key(node=rejected_node).decode()
    assert private.splitlines()[1] not in page and "PRIVATE KEY" not in page
    assert "ssh_private_key" not in page


def test_a_run_without_the_platforms_checks_shows_no_table_of_them(web, provider, rejected_node):
    assert "What the platform measured itself" in web.get(f"/nodes/{rejected_node.pk}/").content.decode()
    node = make_node(provider, name="all-rented", gpu_model="a100-80gb-sxm", gpu_count=2)
    VerificationRun.objects.create(node=node, verdict="verified", findings=[], score=80.0, figures={
        k: v for k, v in FIGURES.items() if k != "challenge"})  # every GPU rented: identity checks only
    assert "What the platform measured itself" not in web.get(f"/nodes/{node.pk}/").content.decode()


def test_the_platforms_own_checks_say_what_was_not_run_and_what_did_not_answer(web, provider):
    node = make_node(provider, name="real", gpu_model="a100-80gb-sxm", gpu_count=2, runtime="docker",
                     state=NodeState.REJECTED, verdict=Verdict.REJECTED)
    challenge = {"gpus": {"0": {"platform_elapsed_s": 9.81, "bf16_tflops": 232.4, "of_datasheet": 0.745,
                                "correct": True},
                          "1": {"node_elapsed_s": None}},  # what judge() keeps of a GPU that did not answer
                 "memory_proof": {"not_run": "the memory proof's deadline on a real GPU is not measured yet"}}
    VerificationRun.objects.create(node=node, verdict="rejected", findings=FINDINGS, score=0.0,
                                   figures={**FIGURES, "challenge": challenge})
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    table = page.split('id="platform-h"', 1)[1].split("</table>", 1)[0]
    rows = [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", row)).strip() for row in table.split("<tr>")[2:]]
    assert rows == ["GPU 0 232.4 74 % 9.81 right – not run", "GPU 1 – – – no answer – not run"]
    assert "Memory proof not run: the memory proof&#x27;s deadline on a real GPU is not measured yet." in page


def test_the_memory_proof_says_held_late_or_wrong_per_gpu(web, provider):
    node = make_node(provider, name="sim", gpu_model="a100-80gb-sxm", gpu_count=3, state=NodeState.REJECTED,
                     verdict=Verdict.REJECTED)
    right = {"platform_elapsed_s": 1.6, "bf16_tflops": 230.0, "of_datasheet": 0.737, "correct": True}
    proof = {"nominal_bytes": 81604378624, "read_deadline_s": 0.1763, "gpus": {
        "0": {"fresh_s": 0.0461, "correct": True}, "1": {"fresh_s": 1.574, "correct": True},
        "2": {"fresh_s": 0.0458, "correct": False}}}
    VerificationRun.objects.create(node=node, verdict="rejected", findings=FINDINGS, score=0.0, figures={
        **FIGURES, "challenge": {"gpus": {g: right for g in ("0", "1", "2")}, "memory_proof": proof}})
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    table = page.split('id="platform-h"', 1)[1].split("</table>", 1)[0]
    rows = [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", row)).strip() for row in table.split("<tr>")[2:]]
    assert rows == ["GPU 0 230.0 74 % 1.60 right 0.046 yes", "GPU 1 230.0 74 % 1.60 right 1.574 late",
                    "GPU 2 230.0 74 % 1.60 right 0.046 wrong"]
    assert "each GPU filled 76.0 GiB from the platform's seed, then re-read all of it under a fresh salt " \
           "within 0.176 s" in page


def test_verify_now_queues_a_check_and_shows_its_steps(web, own_node):
    r = web.post(f"/nodes/{own_node.pk}/verify/", follow=True)
    own_node.refresh_from_db()
    job = Job.objects.get(node=own_node)
    assert own_node.state == NodeState.VERIFYING and job.kind == "node_verify"
    page = r.content.decode()
    assert "Verification queued" in page and f"?watching={job.pk}" in page
    Job.objects.filter(pk=job.pk).update(status="running", step="benchmarking GPUs 0, 1",
                                         log=[{"at": "t", "message": "connecting"},
                                              {"at": "t", "message": "benchmarking GPUs 0, 1"}])
    live = web.get(f"/nodes/{own_node.pk}/live/?watching={job.pk}")
    assert 'id="current-step">benchmarking GPUs 0, 1<' in live.content.decode() and "X-Poll-Stop" not in live
    Job.objects.filter(pk=job.pk).update(status="succeeded", step="done", finished_at=timezone.now())
    live = web.get(f"/nodes/{own_node.pk}/live/?watching={job.pk}")
    assert live["X-Poll-Stop"] == "1" and 'data-reload="1"' in live.content.decode()
    # asking again while one is open changes nothing
    Job.objects.filter(pk=job.pk).update(status="running")
    web.post(f"/nodes/{own_node.pk}/verify/")
    assert Job.objects.filter(node=own_node).count() == 1


def test_settings_change_price_listing_and_maintenance(web, provider):
    node = make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=2, price="0.300000")
    r = web.post(f"/nodes/{node.pk}/settings/", {"price_per_gpu_hour": "0.25", "maintenance": "on"})
    assert r.status_code == 302
    node.refresh_from_db()
    assert node.price_per_gpu_hour_micros == 250000 and not node.listed and node.state == NodeState.MAINTENANCE
    web.post(f"/nodes/{node.pk}/settings/", {"price_per_gpu_hour": "0.25", "listed": "on"})
    node.refresh_from_db()
    assert node.listed and node.state == NodeState.ACTIVE
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    assert 'value="0.25"' in page and re.search(r'name="listed"[^>]*checked', page)


def test_settings_errors_keep_the_input(web, own_node):
    r = web.post(f"/nodes/{own_node.pk}/settings/", {"price_per_gpu_hour": "abc", "listed": "on"})
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_price_per_gpu_hour_errors"' in page and 'value="abc"' in page


def test_settings_conflict_is_explained(web, own_node):
    Node.objects.filter(pk=own_node.pk).update(state=NodeState.VERIFYING)
    r = web.post(f"/nodes/{own_node.pk}/settings/", {"price_per_gpu_hour": "1.5", "maintenance": "on"})
    assert r.status_code == 400 and "cannot go into maintenance" in r.content.decode()


def test_retire_refused_while_rented_then_done(web, provider, stranger):
    node = make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=2)
    instance = book(stranger, node)
    r = web.post(f"/nodes/{node.pk}/retire/", follow=True)
    assert "renters&#x27; instances are live on it (1 requested)" in r.content.decode()
    instance_svc.instance_mark_failed(instance_id=instance.pk, message="gone")  # over: its GPUs released
    r = web.post(f"/nodes/{node.pk}/retire/")
    assert r.status_code == 302 and r["Location"] == "/nodes/", web.get(r["Location"]).content.decode()[-3000:]
    node.refresh_from_db()
    assert node.state == NodeState.RETIRED
    assert web.get(f"/nodes/{node.pk}/").status_code == 404


def test_node_actions_need_csrf(provider, own_node):
    client = Client(enforce_csrf_checks=True)
    client.force_login(provider)
    for action in ("verify", "settings", "retire"):
        assert client.post(f"/nodes/{own_node.pk}/{action}/", {"price_per_gpu_hour": "1"}).status_code == 403
