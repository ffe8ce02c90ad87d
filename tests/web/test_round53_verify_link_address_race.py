"""A verification (or reset) link checked for the old address cannot verify the new one when an operator changes the
address between the link's check and the update: the update named the row alone (review r53, a note)."""
import pytest
from django.test import Client
from django.utils import timezone
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from marketplace.models import User
from marketplace.services import email_verification
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _operator_changes_the_address(user: User, address: str) -> None:
    """What the user admin writes when an operator types another address (marketplace/admin/accounts.py)."""
    User.objects.filter(pk=user.pk).update(email=address, email_verified_at=None, email_changed_at=timezone.now())


def test_a_stale_read_of_the_old_address_does_not_verify_the_new_one():
    user = UserFactory(email="old@example.com", email_verified_at=None)
    stale = User.objects.get(pk=user.pk)  # read, and its link checked, before the change
    _operator_changes_the_address(user, "new@example.com")
    assert email_verification.email_mark_verified(user=stale) is False
    assert User.objects.get(pk=user.pk).email_verified_at is None


def test_changed_away_and_back_the_old_read_does_not_verify_either():
    user = UserFactory(email="old@example.com", email_verified_at=None)
    stale = User.objects.get(pk=user.pk)
    _operator_changes_the_address(user, "new@example.com")
    _operator_changes_the_address(user, "old@example.com")
    assert email_verification.email_mark_verified(user=stale) is False
    assert User.objects.get(pk=user.pk).email_verified_at is None


def test_the_link_checked_before_the_change_answers_that_the_address_changed(monkeypatch):
    user = UserFactory(email="old@example.com", email_verified_at=None)
    tokens = email_verification._tokens
    token = tokens.make_token(user)

    class ChangedRightAfterTheCheck(type(tokens)):
        def check_token(self, user, token):
            ok = super().check_token(user, token)
            _operator_changes_the_address(user, "new@example.com")  # the operator's save lands in the window
            return ok

    monkeypatch.setattr(email_verification, "_tokens", ChangedRightAfterTheCheck())
    r = Client().get(f"/accounts/verify/{urlsafe_base64_encode(force_bytes(user.pk))}/{token}/")
    assert r.status_code == 400 and "changed since" in r.content.decode()
    assert User.objects.get(pk=user.pk).email_verified_at is None


def test_the_link_still_verifies_its_address_and_a_second_click_is_fine():
    user = UserFactory(email="old@example.com", email_verified_at=None)
    fresh = User.objects.get(pk=user.pk)
    again = User.objects.get(pk=user.pk)
    assert email_verification.email_mark_verified(user=fresh) is True
    assert fresh.email_verified_at is not None
    assert email_verification.email_mark_verified(user=again) is True  # read before the first click wrote
    assert User.objects.get(pk=user.pk).email_verified_at == fresh.email_verified_at
