"""A password-reset link sent before a deactivation must not set the password of the account that is off, nor
after it is reactivated (review r46a, finding 2).

PasswordResetConfirmView took the account with Django's get_user (no is_active check) and its token was bound to
the password hash, last log-in, address and time only: the link set the password (and marked the address verified)
of a deactivated account. Now the token is also bound to the account's state (passwords.reset_tokens) and the view
refuses an account that is off.
"""
import pytest
from django.test import Client

from marketplace.models import User
from marketplace.services.account_status import account_deactivate, account_reactivate
from marketplace.services.passwords import password_reset_link
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
NEW = "Another-long pass 42"


def _use(link: str):
    """Open the link and post a new password on the page it leads to, as a browser does."""
    c = Client()
    path = link.removeprefix("http://testserver")
    r = c.get(path, follow=True)
    form_url = r.redirect_chain[-1][0] if r.redirect_chain else path
    return c.post(form_url, {"new_password1": NEW, "new_password2": NEW})


def _link(user):
    return password_reset_link(user=user, base_url="http://testserver/")


def test_a_reset_link_still_works_for_an_account_that_is_on():
    user = UserFactory(email_verified_at=None)
    r = _use(_link(user))
    assert r.status_code == 302, r.status_code
    user = User.objects.get(pk=user.pk)
    assert user.check_password(NEW)
    assert user.email_verified_at is not None


def test_a_reset_link_sent_before_deactivation_does_not_set_the_password_of_the_account_that_is_off():
    user = UserFactory(email_verified_at=None)
    link = _link(user)
    account_deactivate(user=user, reason="abuse")
    _use(link)
    user = User.objects.get(pk=user.pk)
    assert not user.check_password(NEW)
    assert user.email_verified_at is None


def test_a_reset_link_sent_before_deactivation_stays_void_after_reactivation():
    user = UserFactory(email_verified_at=None)
    link = _link(user)
    account_deactivate(user=user, reason="abuse")
    account_reactivate(user=User.objects.get(pk=user.pk), reason="sorted out")
    r = _use(link)
    user = User.objects.get(pk=user.pk)
    assert user.is_active
    assert not user.check_password(NEW), r.status_code
    assert user.email_verified_at is None
    # A link sent now works.
    assert _use(_link(user)).status_code == 302
    assert User.objects.get(pk=user.pk).check_password(NEW)
