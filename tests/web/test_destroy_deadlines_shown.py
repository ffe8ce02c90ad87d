"""BillingProfile.destroy_deadlines (ea8cc11: what the zero-balance grace period destroys, and when) was shown
nowhere: not on the billing profile's admin page, not to the renter (the balance API and page). Now the admin page
shows each thing (linked to its admin page while it exists), its time in UTC and whether a warning named it, read
only; the renter sees their own on GET /api/v1/billing/balance/ and the balance page, while at zero."""
import pytest
from rest_framework.test import APIClient

from billing.models import BillingProfile
from billing.services.customers import profile_for
from marketplace.services.accounts import api_key_create
from tests.billing.helpers import book, fund, node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

BALANCE = "/api/v1/billing/balance/"


def _record(profile: BillingProfile, record: dict) -> None:
    BillingProfile.objects.filter(pk=profile.pk).update(destroy_deadlines=record)


def _api(user) -> APIClient:
    _, raw = api_key_create(user=user, name="balance", scopes=["renter"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_the_admin_page_shows_each_deadline_linked_escaped_and_read_only(operator, renter):
    fund(renter, "100")
    instance = book(renter, node())
    profile = profile_for(user=renter)
    _record(profile, {
        f"instance:{instance.pk}": {"at": "2026-12-09T10:00:00+00:00", "warned": True},
        "volume:987654": {"at": "2026-12-08T09:30:00+01:00", "warned": False},  # gone: its id alone, time in UTC
        "<script>alert(1)</script>:1": {"at": "2026-12-08T09:30:00+00:00", "warned": True},  # not the form: left out
    })
    page = logged_in(operator).get(f"/admin/billing/billingprofile/{profile.pk}/change/").content.decode()
    assert f'<a href="/admin/marketplace/instance/{instance.pk}/change/">instance {instance.pk}</a>' in page
    assert "2026-12-09 10:00:00 UTC" in page and "warned" in page
    assert "volume 987654 (gone)" in page and "2026-12-08 08:30:00 UTC" in page and "not warned yet" in page
    assert page.index("volume 987654") < page.index(f"instance {instance.pk}")  # soonest first
    assert "<script>alert(1)" not in page
    assert 'name="destroy_deadlines"' not in page  # shown, never a form field


def test_the_admin_page_says_none_when_nothing_is_due(operator, renter):
    profile = profile_for(user=renter)
    page = logged_in(operator).get(f"/admin/billing/billingprofile/{profile.pk}/change/").content.decode()
    assert "destroy deadlines" in page.lower()
    assert "destroyed at</th>" not in page


def test_the_balance_api_and_page_list_the_renters_own_deadlines_at_zero(renter, stranger):
    _record(profile_for(user=renter), {
        "instance:41": {"at": "2026-12-09T10:00:00+00:00", "warned": True},
        "volume:7": {"at": "2026-12-08T10:00:00+00:00", "warned": False},
    })
    _record(profile_for(user=stranger), {"volume:99": {"at": "2026-12-08T10:00:00+00:00", "warned": True}})
    body = _api(renter).get(BALANCE).json()
    assert body["destroy_deadlines"] == [
        {"kind": "volume", "id": 7, "destroy_at": "2026-12-08T10:00:00Z", "warned": False},
        {"kind": "instance", "id": 41, "destroy_at": "2026-12-09T10:00:00Z", "warned": True},
    ]
    page = logged_in(renter).get("/account/balance/").content.decode()
    assert 'id="destroy-deadlines"' in page
    assert 'href="/instances/41/">instance 41</a>' in page and "2026-12-09 10:00 UTC" in page
    assert "volume 7" in page and "volume 99" not in page
    assert _api(stranger).get(BALANCE).json()["destroy_deadlines"] == [
        {"kind": "volume", "id": 99, "destroy_at": "2026-12-08T10:00:00Z", "warned": True}]


def test_nothing_is_listed_when_none_is_due_or_the_balance_is_above_zero(renter):
    client = _api(renter)
    assert client.get(BALANCE).json()["destroy_deadlines"] == []
    assert 'id="destroy-deadlines"' not in logged_in(renter).get("/account/balance/").content.decode()
    # Topped up: the record waits for the next enforcement tick to be cleared, but nothing is destroyed now.
    _record(profile_for(user=renter), {"volume:7": {"at": "2026-12-08T10:00:00+00:00", "warned": True}})
    fund(renter, "10")
    assert client.get(BALANCE).json()["destroy_deadlines"] == []
    assert 'id="destroy-deadlines"' not in logged_in(renter).get("/account/balance/").content.decode()
