"""Who reads GET /metrics (core/metrics.py `metrics_allowed`): operators only, a staff session holding the view
permissions of what the page counts, or `Authorization: Bearer <METRICS_TOKEN>` compared in constant time.

Checked in review round 44 and found sound: a renter's session gets the 404 an anonymous request gets (the endpoint
is not advertised), and an API key, a renter's or a staff user's, is no credential here (the view is no DRF view and
takes no API key): sent as a bearer token it is a wrong metrics token, a 401. The operators' dashboard (/admin/)
sends both to the admin's log-in. Nothing was changed; this holds it."""
import hmac

import pytest
from django.test import Client

from tests.factories import UserFactory, api_key_for, make_listed_node

TOKEN = "metrics-token-round44-0123456789abcdef"  # noqa: S105
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def token(settings):
    settings.METRICS_TOKEN = TOKEN


def _get(client=None, **headers):
    return (client or Client()).get("/metrics", **headers)


def _logged_in(user):
    client = Client()
    client.force_login(user)
    return client


def test_nobody_but_operators_reads_the_metrics():
    node = make_listed_node()
    renter = UserFactory()
    assert _get().status_code == 404  # anonymous
    assert _get(_logged_in(renter)).status_code == 404  # a renter's session
    assert _get(_logged_in(node.provider)).status_code == 404  # a provider's session
    for user in (renter, UserFactory(is_staff=True, is_superuser=True)):
        key = api_key_for(user)
        for header in (f"Bearer {key}", f"bearer {key}", f"Token {key}", key):
            answer = _get(HTTP_AUTHORIZATION=header)
            assert answer.status_code in (401, 404), (header[:12], answer.status_code)
            assert b"gpumarket_" not in answer.content
        assert _get(HTTP_X_API_KEY=key).status_code == 404
    # A right token beside a renter's session reads it; a wrong one beside a staff session does not.
    assert _get(_logged_in(renter), HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    staff = _logged_in(UserFactory(is_staff=True, is_superuser=True))
    assert _get(staff, HTTP_AUTHORIZATION=f"Bearer {TOKEN[:-1]}").status_code == 401
    assert _get(staff).status_code == 200
    # The operators' dashboard, the other page of fleet figures: the admin's log-in for a renter or a key.
    with_key = {"HTTP_AUTHORIZATION": f"Bearer {api_key_for(renter)}"}
    for client, headers in ((_logged_in(renter), {}), (Client(), with_key)):
        answer = client.get("/admin/", **headers)
        assert answer.status_code == 302 and "/login/" in answer["Location"], answer.status_code


def test_an_inactive_or_permissionless_staff_account_reads_nothing():
    inactive = UserFactory(is_staff=True, is_superuser=True)
    client = _logged_in(inactive)
    inactive.is_active = False
    inactive.save(update_fields=["is_active"])
    assert _get(client).status_code == 404
    assert _get(_logged_in(UserFactory(is_staff=True))).status_code == 403  # staff without the view permissions


def test_the_token_is_compared_in_constant_time(monkeypatch, settings):
    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("core.metrics.hmac.compare_digest", spy)
    assert _get(HTTP_AUTHORIZATION="Bearer guess").status_code == 401
    assert _get(HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert compared == [(b"guess", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]
    settings.METRICS_TOKEN = ""  # no token set: none is accepted, the empty one neither
    for header in ("Bearer ", "Bearer", f"Bearer {TOKEN}"):
        assert _get(HTTP_AUTHORIZATION=header).status_code == 401, header
