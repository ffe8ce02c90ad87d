"""A staff account's API keys are a superuser's to revoke, as the account itself is a superuser's to change
(marketplace/admin/accounts.py UserAdmin.has_change_permission). Review r46b #2: a non-superuser staff account with
marketplace.change_apikey revoked a superuser's keys from the API key list."""
import pytest
from django.contrib import messages

from marketplace.models import ApiKey
from tests.factories import UserFactory, api_key_for
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, staff, staff_with

pytestmark = pytest.mark.django_db

KEY_PERMS = ("marketplace.view_apikey", "marketplace.change_apikey")


def key_of(user) -> ApiKey:
    api_key_for(user)
    return ApiKey.objects.get(user=user)


def test_non_superuser_staff_cannot_revoke_a_superusers_or_staff_api_keys_and_the_others_are_revoked():
    boss_key = key_of(UserFactory(is_staff=True, is_superuser=True))
    colleague_key = key_of(UserFactory(is_staff=True))
    renter_key = key_of(UserFactory())
    r = act(staff_with(*KEY_PERMS), "marketplace/apikey", "revoke", boss_key.pk, colleague_key.pk, renter_key.pk)
    for key in (boss_key, colleague_key, renter_key):
        key.refresh_from_db()
    assert boss_key.revoked_at is None, "a non-superuser staff account revoked a superuser's API key"
    assert colleague_key.revoked_at is None, "a non-superuser staff account revoked another staff account's key"
    assert renter_key.revoked_at is not None  # the other selected key still revoked
    said = {(m.level, m.message) for m in messages.get_messages(r.wsgi_request)}
    errors = [text for level, text in said if level == messages.ERROR]
    assert len(errors) == 1 and boss_key.prefix in errors[0] and colleague_key.prefix in errors[0]
    assert (messages.SUCCESS, "Revoked the other selected keys.") in said


def test_a_superuser_revokes_staff_accounts_keys():
    boss_key = key_of(UserFactory(is_staff=True, is_superuser=True))
    colleague_key = key_of(UserFactory(is_staff=True))
    act(logged_in(UserFactory(is_staff=True, is_superuser=True)), "marketplace/apikey", "revoke", boss_key.pk,
        colleague_key.pk)
    for key in (boss_key, colleague_key):
        key.refresh_from_db()
        assert key.revoked_at is not None


def test_a_superusers_key_page_is_read_only_to_non_superuser_staff():
    boss_key = key_of(UserFactory(is_staff=True, is_superuser=True))
    renter_key = key_of(UserFactory())
    helper = staff(*KEY_PERMS)
    client = logged_in(helper)
    page = client.get(f"/admin/marketplace/apikey/{boss_key.pk}/change/")
    assert page.status_code == 200 and page.context["has_change_permission"] is False  # shown, view only
    assert client.post(f"/admin/marketplace/apikey/{boss_key.pk}/change/", {}).status_code == 403
    assert client.get(f"/admin/marketplace/apikey/{renter_key.pk}/change/").context["has_change_permission"] is True
