"""Deactivating an account ends its sessions for good: a (possibly stolen) session cookie from before does not work
again once the account is reactivated. Its API keys are kept on purpose: the reactivation notice promises they
work again (an owner revokes a leaked key themselves)."""

import pytest
from django.test import Client

from marketplace.services.account_status import account_deactivate, account_reactivate
from tests.factories import UserFactory, api_key_for
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def test_a_session_from_before_a_deactivation_does_not_come_back_on_reactivation():
    user, operator = UserFactory(), UserFactory(is_staff=True, is_superuser=True)
    stolen = logged_in(user)
    key = api_key_for(user)
    assert stolen.get("/api/v1/auth/me/").status_code == 200
    account_deactivate(user=user, by=operator, reason="compromised")
    assert stolen.get("/api/v1/auth/me/").status_code in (401, 403)
    account_reactivate(user=user, by=operator)
    assert stolen.get("/api/v1/auth/me/").status_code in (401, 403)
    # Intended: the key is kept, working again once on (refused while off: below).
    assert Client().get("/api/v1/auth/me/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200
    # A new log-in works as ever.
    assert logged_in(user).get("/api/v1/auth/me/").status_code == 200


def test_the_key_is_refused_while_the_account_is_off():
    user, operator = UserFactory(), UserFactory(is_staff=True, is_superuser=True)
    key = api_key_for(user)
    account_deactivate(user=user, by=operator)
    assert Client().get("/api/v1/auth/me/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code in (401, 403)
