"""Offers, GPU comparison, renting and instance pages, with Django's test client."""
import re

import pytest
from django.test import Client

from marketplace.models import Instance, Node, NodeState, SshKey, Verdict
from provisioning.models import Job, VerificationRun
from tests.factories import make_listed_node, make_node
from tests.marketplace.renting_helpers import add_key, book, ed25519_key, run
from tests.web.conftest import PASSWORD, fund, logged_in

pytestmark = pytest.mark.django_db


def _ids(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'href="/offers/(\d+)/rent/"', page)]


@pytest.fixture
def fleet(db):
    """Listed nodes of three models at different prices, and two that are not bookable."""
    return {
        "a100_cheap": make_listed_node(gpu_model="a100-80gb-sxm", price="1.200000", country="DE", score=90.0),
        "a100_dear": make_listed_node(gpu_model="a100-80gb-sxm", price="1.900000", country="US", score=95.0),
        "a6000": make_listed_node(gpu_model="rtx-a6000", price="0.490000", country="NL", gpu_count=8, score=40.0),
        "h100": make_listed_node(gpu_model="h100-sxm", price="2.490000", country="US", gpu_count=1, score=260.0),
        "pending": make_node(gpu_model="a100-80gb-sxm"),
        "rejected": make_node(gpu_model="a100-80gb-sxm", state=NodeState.REJECTED, verdict=Verdict.REJECTED),
    }


# ------------------------------------------------------------------------------------------- offers

def test_offers_are_public_and_only_bookable_nodes(client, fleet):
    r = client.get("/offers/")
    assert r.status_code == 200
    shown = set(_ids(r.content.decode()))
    assert shown == {fleet[k].pk for k in ("a100_cheap", "a100_dear", "a6000", "h100")}


@pytest.mark.parametrize("query", [
    "gpu_model=a100-80gb-sxm",
    "gpu_model=a100-80gb-sxm&gpu_model=h100-sxm&ordering=-price_per_gpu_hour",
    "min_gpus=4&ordering=price_per_gpu_hour",
    "max_price_per_gpu_hour=1.5",
    "country=US&ordering=-score",
    "min_score=80&min_gpu_memory_gb=80",
    "min_reliability=0.9&ordering=score_per_dollar",
    "ordering=reliability",
])
def test_offers_filter_and_order_exactly_as_the_api(client, fleet, query):
    web_ids = _ids(client.get(f"/offers/?{query}").content.decode())
    api_ids = [o["id"] for o in client.get(f"/api/v1/offers/?{query}").json()["results"]]
    assert web_ids == api_ids and web_ids


def test_empty_filter_fields_are_ignored_as_a_form_sends_them(client, fleet):
    r = client.get("/offers/?gpu_model=a100-80gb-sxm&min_gpus=&max_price_per_gpu_hour=&country=&city=&ordering=")
    assert r.status_code == 200
    assert set(_ids(r.content.decode())) == {fleet["a100_cheap"].pk, fleet["a100_dear"].pk}
    assert re.search(r'<input[^>]*value="a100-80gb-sxm"[^>]*checked', r.content.decode())


def test_a_bad_filter_is_explained_next_to_it_and_kept(client, fleet):
    r = client.get("/offers/?min_gpus=two&city=Berlin")
    assert r.status_code == 400
    page = r.content.decode()
    assert 'id="id_min_gpus_errors"' in page and 'value="two"' in page and 'value="Berlin"' in page
    assert _ids(page) == []


def test_offers_are_paginated(client, db):
    for _ in range(23):
        make_listed_node(gpu_model="rtx-a4000", gpu_count=1)
    first = client.get("/offers/?gpu_model=rtx-a4000").content.decode()
    second = client.get("/offers/?gpu_model=rtx-a4000&page=2").content.decode()
    assert len(_ids(first)) == 20 and len(_ids(second)) == 3
    assert "Page 1 of 2" in first and "gpu_model=rtx-a4000&amp;page=2" in first
    assert not set(_ids(first)) & set(_ids(second))


# --------------------------------------------------------------------------------------- comparison

def test_comparison_says_not_measured_without_runs_and_prices_per_tflop(client, fleet):
    page = client.get("/gpus/?models=a100-80gb-sxm&models=rtx-a6000").content.decode()
    assert "A100 80GB SXM" in page and "RTX A6000" in page and "H100 SXM" not in page.split("<table")[1]
    assert "not measured yet" in page
    # $1.20 per GPU-hour / 312 datasheet BF16 TFLOP/s
    assert "0.38 ¢" in page and "(datasheet)" in page
    assert "<svg" in page and 'role="img"' in page


def test_comparison_uses_the_measured_medians(client, fleet):
    node = fleet["a100_cheap"]
    figures = {"median": {"bf16_tflops": 270.0, "tf32_tflops": 140.0, "fp32_tflops": 19.0,
                          "memory_bandwidth_gbs": 1800.0, "cnn_train_images_s": 2500.0},
               "datasheet": {"bf16_tflops": 312.0, "memory_bandwidth_gbs": 2039.0}, "gpus": []}
    VerificationRun.objects.create(node=node, verdict="verified", figures=figures, score=90.0)
    page = client.get("/gpus/?models=a100-80gb-sxm").content.decode()
    assert "270.0" in page and "87 %" in page.replace("87%", "87 %")
    assert "2,500" in page and "0.44 ¢" in page and "(measured)" in page  # 1.20 / 270


def test_comparison_shows_measured_bf16_per_watt_of_verified_servers_only(client, fleet):
    a100 = "/gpus/?models=a100-80gb-sxm"
    assert "BF16 per watt" in client.get(a100).content.decode()
    row = lambda page: page.split("BF16 per watt")[1].split("</tr>")[0]  # noqa: E731
    assert "not measured yet" in row(client.get(a100).content.decode())  # never the datasheet's 312/400
    for node, per_w, verdict in ((fleet["a100_cheap"], 0.66, "verified"), (fleet["a100_dear"], 0.70, "verified")):
        VerificationRun.objects.create(node=node, verdict=verdict, figures={"median": {"bf16_tflops_per_w": per_w}})
    a6000 = make_node(gpu_model="rtx-a6000", state=NodeState.ACTIVE, verdict=Verdict.DEGRADED)
    VerificationRun.objects.create(node=a6000, verdict="degraded", figures={"median": {"bf16_tflops_per_w": 0.4}})
    page = client.get(a100).content.decode()
    assert "680" in row(page) and "2 servers" in row(page)  # median 0.68 TFLOP/s per W, in GFLOP/s per W
    page = client.get("/gpus/?models=rtx-a6000").content.decode()
    assert "not measured yet" in row(page) and "400" not in row(page)  # a degraded node is no fair sample


def test_comparison_defaults_to_models_on_offer(client, fleet):
    page = client.get("/gpus/").content.decode()
    head = page.split("<thead>")[1].split("</thead>")[0]
    assert "A100 80GB SXM" in head and "H100 SXM" in head and "RTX A4000" not in head


# ------------------------------------------------------------------------------------------- renting

def test_rent_needs_login_and_a_bookable_offer(client, fleet, web):
    r = client.get(f"/offers/{fleet['a6000'].pk}/rent/")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]
    assert web.get(f"/offers/{fleet['pending'].pk}/rent/").status_code == 404
    assert web.get(f"/offers/{fleet['rejected'].pk}/rent/").status_code == 404
    page = web.get(f"/offers/{fleet['a6000'].pk}/rent/").content.decode()
    assert "PyTorch" in page and "TensorFlow" in page and 'name="request_token"' in page


def test_rent_with_a_pasted_key_books_and_opens_the_instance(web, funded_renter, fleet):
    node = fleet["a6000"]
    key = ed25519_key("me@laptop")
    r = web.post(f"/offers/{node.pk}/rent/", {"image": "pytorch-2-5", "num_gpus": "2", "ssh_public_key": key,
                                              "save_key": "on", "save_key_password": PASSWORD, "label": "training",
                                              "request_token": "t1"})
    assert r.status_code == 302
    instance = Instance.objects.get(renter=funded_renter)
    assert r["Location"] == f"/instances/{instance.pk}/"
    assert instance.num_gpus == 2 and instance.label == "training" and instance.image.slug == "pytorch-2-5"
    assert instance.ssh_public_keys == [" ".join(key.split()[:2])]
    assert SshKey.objects.filter(user=funded_renter).count() == 1
    assert Job.objects.filter(instance=instance, kind="instance_provision").exists()


def test_rent_twice_with_one_form_books_once(web, funded_renter, fleet):
    body = {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "same"}
    first = web.post(f"/offers/{fleet['a6000'].pk}/rent/", body)
    second = web.post(f"/offers/{fleet['a6000'].pk}/rent/", body)
    assert first["Location"] == second["Location"]
    assert Instance.objects.filter(renter=funded_renter).count() == 1


def test_rent_with_a_saved_key(web, funded_renter, fleet):
    saved = add_key(funded_renter, "laptop")
    r = web.post(f"/offers/{fleet['a100_cheap'].pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1",
                                                             "ssh_keys": [str(saved.pk)], "request_token": "x"})
    assert r.status_code == 302
    assert Instance.objects.get(renter=funded_renter).ssh_public_keys == [saved.public_key]


def test_rent_errors_show_next_to_the_field_and_keep_the_input(web, funded_renter, fleet):
    node = fleet["a6000"]
    r = web.post(f"/offers/{node.pk}/rent/", {"image": "tensorflow-2-17", "num_gpus": "2",
                                              "ssh_public_key": "ssh-rsa AAAAB3NzaC1yc2E= short", "label": "mine",
                                              "request_token": "t"})
    page = r.content.decode()
    assert r.status_code == 400
    assert 'id="id_ssh_public_key_errors"' in page and "ssh-rsa AAAAB3NzaC1yc2E= short</textarea>" in page
    assert 'value="mine"' in page and re.search(r'value="tensorflow-2-17"[^>]*checked', page)
    assert re.search(r'name="num_gpus"[^>]*value="2"|value="2"[^>]*name="num_gpus"', page)

    r = web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1", "request_token": "t"})
    assert r.status_code == 400 and 'id="id_ssh_keys_errors"' in r.content.decode()

    r = web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "9", "ssh_public_key": ed25519_key()})
    assert r.status_code == 400 and 'id="id_num_gpus_errors"' in r.content.decode()
    assert not Instance.objects.exists()


def test_rent_more_gpus_than_are_free_is_explained(web, funded_renter, stranger, fleet):
    node = fleet["a100_cheap"]
    fund(stranger)
    book(stranger, node, num_gpus=3)
    r = web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "2", "ssh_public_key": ed25519_key(),
                                              "request_token": "t"})
    assert r.status_code == 400 and "free on this node now" in r.content.decode()


def test_rent_without_funds_says_so(web, renter, fleet, settings):
    settings.BILLING_REQUIRE_FUNDS = True
    r = web.post(f"/offers/{fleet['a6000'].pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1",
                                                        "ssh_public_key": ed25519_key(), "request_token": "t"})
    page = r.content.decode()
    assert r.status_code == 400 and "balance" in page
    assert "/api/" not in page.split('<form method="post"')[1]  # the service's wording names the API's endpoint
    assert "$0.49 per hour" in page and not re.search(r"\$[\d,]*\.\d{3}", page)
    assert not Instance.objects.exists()


def test_prices_per_gpu_hour_show_every_decimal_and_agree_with_the_sum(web, funded_renter, client):
    """$1.504 per GPU-hour showed as $1.50, and the estimate "2 GPUs × $1.50 = $3.01": the price that is charged
    and filtered on is shown as it is; balances stay in cents."""
    node = make_listed_node(price="1.504000", gpu_count=4)
    offers = client.get("/offers/").content.decode()
    assert "$1.504" in offers and "$1.50<" not in offers
    page = web.get(f"/offers/{node.pk}/rent/?num_gpus=2").content.decode()
    assert "$1.504 per GPU-hour" in page
    r = web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "2", "ssh_public_key": "bad",
                                              "request_token": "t"})
    text = " ".join(re.sub(r"<[^>]+>", " ", r.content.decode()).split())
    assert r.status_code == 400 and "2 GPUs × $1.504 per GPU-hour = $3.008 per hour" in text, text


def test_a_refused_booking_saves_no_pasted_key(web, renter, fleet, settings):
    """"Also save this key" saved it before booking: a booking refused (no funds here) left a saved key behind."""
    settings.BILLING_REQUIRE_FUNDS = True
    r = web.post(f"/offers/{fleet['a6000'].pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1", "save_key": "on",
                                                        "save_key_password": PASSWORD,
                                                        "ssh_public_key": ed25519_key(), "request_token": "t"})
    assert r.status_code == 400 and "balance" in r.content.decode()
    assert not Instance.objects.exists() and not SshKey.objects.filter(user=renter).exists()


@pytest.mark.parametrize("password, said", [("", "Type your password to save this key"),
                                             ("not it", "Your password was entered incorrectly")])
def test_saving_a_pasted_key_needs_the_password_and_without_it_nothing_is_booked(web, funded_renter, fleet,
                                                                                password, said):
    """A saved key opens every instance rented later: the rent page's "also save" asks what the SSH keys page asks,
    before anything is booked; unticked, the pasted key goes on this instance only and no password is needed."""
    url = f"/offers/{fleet['a6000'].pk}/rent/"
    r = web.post(url, {"image": "cuda-12-4", "num_gpus": "1", "save_key": "on", "save_key_password": password,
                       "ssh_public_key": ed25519_key(), "request_token": "t"})
    assert r.status_code == 400 and said in r.content.decode() and 'id="id_save_key_password_errors"' in \
        r.content.decode()
    assert not Instance.objects.exists() and not SshKey.objects.exists()
    r = web.post(url, {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "t"})
    assert r.status_code == 302 and Instance.objects.count() == 1 and not SshKey.objects.exists()


def test_a_booking_stands_when_its_key_cannot_be_saved_and_the_page_says_why(web, funded_renter, fleet, settings):
    from marketplace.services.ssh_keys import MAX_SAVED_SSH_KEYS
    for n in range(MAX_SAVED_SSH_KEYS):
        add_key(funded_renter, f"key {n}")
    r = web.post(f"/offers/{fleet['a6000'].pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1", "save_key": "on",
                                                        "save_key_password": PASSWORD,
                                                        "ssh_public_key": ed25519_key(), "request_token": "t"},
                 follow=True)
    instance = Instance.objects.get(renter=funded_renter)
    assert r.redirect_chain[-1][0] == f"/instances/{instance.pk}/"
    assert "The key was not saved to your SSH keys" in r.content.decode()
    assert SshKey.objects.filter(user=funded_renter).count() == MAX_SAVED_SSH_KEYS


def test_rent_with_a_pasted_key_saved_already_books_and_keeps_one(web, funded_renter, fleet):
    key = ed25519_key("me@laptop")
    add = web.post("/account/ssh-keys/", {"public_key": key, "password": PASSWORD})
    assert add.status_code == 302 and SshKey.objects.filter(user=funded_renter).count() == 1
    r = web.post(f"/offers/{fleet['a6000'].pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1", "save_key": "on",
                                                        "save_key_password": PASSWORD,
                                                        "ssh_public_key": key, "request_token": "t"})
    assert r.status_code == 302 and SshKey.objects.filter(user=funded_renter).count() == 1


def test_rent_ticks_the_only_saved_key(web, funded_renter, fleet):
    url = f"/offers/{fleet['a100_cheap'].pk}/rent/"
    key = add_key(funded_renter, "laptop")
    assert re.search(rf'value="{key.pk}"[^>]*checked|checked[^>]*value="{key.pk}"', web.get(url).content.decode())
    add_key(funded_renter, "desktop")  # two keys: the renter chooses
    assert not re.search(r'name="ssh_keys"[^>]*checked', web.get(url).content.decode())


def test_rent_shows_the_estimate_at_the_whole_burn_rate(web, funded_renter, fleet):
    from billing.services.ledger import wallet_balance

    book(funded_renter, fleet["a6000"], num_gpus=2)  # $0.98 per hour already committed
    balance = wallet_balance(user_id=funded_renter.pk)
    page = web.get(f"/offers/{fleet['a100_cheap'].pk}/rent/").content.decode()
    estimate = re.sub(r"<[^>]+>|\s+", " ", page.split('id="estimate"')[1].split("</section>")[0])
    estimate = re.sub(r"\s+", " ", estimate)
    assert "1 GPU × $1.20 per GPU-hour = $1.20 per hour" in estimate
    assert "($0.98 per hour) you would pay $2.18 per hour" in estimate
    hours = balance / 2_180_000
    assert f"lasts about {int(hours // 24)} d {int(hours % 24)} h" in estimate, (estimate, hours)
    # A form sent back with 3 GPUs: the estimate follows it.
    r = web.post(f"/offers/{fleet['a100_cheap'].pk}/rent/", {"image": "cuda-12-4", "num_gpus": "3",
                                                             "request_token": "t", "ssh_keys": []})
    assert r.status_code == 400 and "3 GPUs</span> × $1.20 per GPU-hour" in r.content.decode()


def test_rent_form_needs_csrf(csrf_web, funded_renter, fleet):
    r = csrf_web.post(f"/offers/{fleet['a6000'].pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1",
                                                             "ssh_public_key": ed25519_key()})
    assert r.status_code == 403 and not Instance.objects.exists()


# ----------------------------------------------------------------------------------------- instances

@pytest.fixture
def running(funded_renter, fleet):
    instance = book(funded_renter, fleet["a100_cheap"], num_gpus=2)
    return run(instance, host="127.0.0.1", port=40022)


def test_instances_list_shows_only_mine(web, stranger, running, fleet):
    fund(stranger)
    theirs = book(stranger, fleet["a6000"])
    page = web.get("/instances/").content.decode()
    assert f'href="/instances/{running.pk}/"' in page and f'href="/instances/{theirs.pk}/"' not in page


def test_instance_page_shows_the_ssh_command_and_buttons(web, running):
    r = web.get(f"/instances/{running.pk}/")
    page = r.content.decode()
    assert "ssh -p 40022 root@127.0.0.1" in page
    for verb in ("stop", "restart", "destroy"):
        assert f'action="/instances/{running.pk}/{verb}/"' in page
    assert f'action="/instances/{running.pk}/start/"' not in page
    assert 'aria-live="polite"' in page and f'data-poll-url="/instances/{running.pk}/live/"' in page


def test_instance_live_part_says_when_to_stop_polling(web, running):
    r = web.get(f"/instances/{running.pk}/live/")
    assert r.status_code == 200 and 'data-slot="state"' in r.content.decode()
    assert r["X-Poll-Interval"] == "10000" and "X-Poll-Stop" not in r
    Instance.objects.filter(pk=running.pk).update(status="failed", status_message="The node vanished")
    r = web.get(f"/instances/{running.pk}/live/")
    assert r["X-Poll-Stop"] == "1" and "The node vanished" in r.content.decode()


def test_instance_shows_the_current_step_while_provisioning(web, funded_renter, fleet):
    instance = book(funded_renter, fleet["a6000"])
    Job.objects.filter(instance=instance).update(status="running", step="pulling the image",
                                                 log=[{"at": "x", "message": "started"},
                                                      {"at": "y", "message": "pulling the image"}])
    page = web.get(f"/instances/{instance.pk}/live/").content.decode()
    assert 'id="current-step">pulling the image<' in page and "<li>started</li>" in page


def test_another_users_instance_is_a_404_everywhere(stranger, running):
    other = logged_in(stranger)
    for url in (f"/instances/{running.pk}/", f"/instances/{running.pk}/live/"):
        assert other.get(url).status_code == 404
    for verb in ("stop", "start", "restart", "destroy"):
        assert other.post(f"/instances/{running.pk}/{verb}/").status_code == 404
    running.refresh_from_db()
    assert running.status == "running"


def test_stop_then_an_impossible_start_is_explained(web, running):
    r = web.post(f"/instances/{running.pk}/stop/", follow=True)
    running.refresh_from_db()
    assert running.status == "stopping" and "Stopping instance" in r.content.decode()
    r = web.post(f"/instances/{running.pk}/start/", follow=True)
    assert "stopping" in r.content.decode().lower() and "start it once it is stopped" in r.content.decode()


def test_destroy_and_unknown_verbs(web, running):
    assert web.post(f"/instances/{running.pk}/explode/").status_code == 404
    assert web.get(f"/instances/{running.pk}/destroy/").status_code == 405
    web.post(f"/instances/{running.pk}/destroy/")
    running.refresh_from_db()
    assert running.status == "destroying"
    assert Job.objects.filter(instance=running, kind="instance_destroy").exists()


def test_instance_verbs_need_csrf(funded_renter, running):
    client = Client(enforce_csrf_checks=True)
    client.force_login(funded_renter)
    assert client.post(f"/instances/{running.pk}/destroy/").status_code == 403
    running.refresh_from_db()
    assert running.status == "running"


def test_offer_page_never_shows_node_secrets(client, fleet):
    node = Node.objects.get(pk=fleet["a6000"].pk)
    for page in (client.get("/offers/").content.decode(), client.get("/gpus/").content.decode()):
        assert node.ssh_public_key not in page and node.address not in page and "PRIVATE KEY" not in page


def test_a_missing_page_is_a_friendly_404(web):
    r = web.get("/instances/999999/")
    assert r.status_code == 404 and "Not found" in r.content.decode() and 'href="/offers/"' in r.content.decode()


def test_offers_page_shows_and_filters_nvlink(client, fleet):
    node = fleet["a100_cheap"]
    node.benchmark_summary = {"verdict": "verified", "findings": [], "median_per_gpu": {},
                              "nvlink": {"connected": True, "islands": [[0, 1, 2, 3]], "links_per_gpu": 12,
                                         "p2p_gbs": 231.4, "pcie_p2p_gbs": None}}
    node.save(update_fields=["benchmark_summary"])
    page = client.get("/offers/").content.decode()
    assert "NVLink 231 GB/s p2p" in page and 'name="nvlink"' in page
    assert _ids(client.get("/offers/?nvlink=true").content.decode()) == [node.pk]
    assert node.pk not in _ids(client.get("/offers/?nvlink=false").content.decode())
