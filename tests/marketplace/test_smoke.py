import re

import pytest

from tests.factories import make_listed_node

pytestmark = pytest.mark.django_db


def test_register_then_use_key(anon, mailoutbox):
    r = anon.post("/api/v1/auth/register/", {"email": "A@Example.com", "password": "a long enough pass 42"},
                  format="json")
    assert r.status_code == 202, r.content
    token = re.search(r"^The token: (\S+)$", mailoutbox[-1].body, re.M).group(1)
    r = anon.post("/api/v1/auth/confirm/", {"token": token, "password": "a long enough pass 42"}, format="json")
    assert r.status_code == 201, r.content
    key = r.json()["api_key"]
    assert r.json()["user"]["email"] == "a@example.com"
    anon.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert anon.get("/api/v1/auth/me/").json()["email"] == "a@example.com"


def test_node_register_and_offer(api):
    r = api.post("/api/v1/nodes/", {
        "name": "box1", "address": "9.9.9.9", "ssh_port": 22, "ssh_user": "ubuntu", "country": "DE",
        "gpu_model": "rtx-a6000", "gpu_count": 8, "price_per_gpu_hour": "0.79", "runtime": "docker",
    }, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["state"] == "pending" and len(body["gpus"]) == 8
    assert body["public_key"].startswith("ssh-ed25519 ")
    assert "private" not in str(body).lower()
    make_listed_node(gpu_model="h100-sxm", gpu_count=1)
    offers = api.get("/api/v1/offers/?gpu_model=h100-sxm").json()
    assert offers["count"] == 1 and offers["results"][0]["num_gpus_free"] == 1
