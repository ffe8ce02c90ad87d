"""Setting a password on the site (the reset link's page, the password change page) writes the password alone: Django's
forms saved the whole user row as read at the request's start, so an operator's change of the address or of the
active flag committed meanwhile was written back to its old value (a deactivated account came back on)."""
import pytest
from django.contrib.auth import get_user_model
from django.test import RequestFactory

from marketplace.admin.accounts import AdminPasswordChangeForm
from marketplace.web.passwords import PasswordChangeView, PasswordResetConfirmView
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db

NEW_PASSWORD = "a brand new passphrase 77"
User = get_user_model()


def _operator_changes_the_account_meanwhile(user) -> None:
    User.objects.filter(pk=user.pk).update(email="moved@example.com", email_canonical="moved@example.com",
                                           is_active=False)


def _after(user):
    fresh = User.objects.get(pk=user.pk)
    assert fresh.check_password(NEW_PASSWORD)  # the password is set all the same
    return fresh


def test_a_reset_keeps_an_address_and_active_flag_changed_meanwhile(renter):
    form = PasswordResetConfirmView.form_class(renter, data={"new_password1": NEW_PASSWORD,
                                                             "new_password2": NEW_PASSWORD})
    assert form.is_valid(), form.errors
    _operator_changes_the_account_meanwhile(renter)
    form.save()
    fresh = _after(renter)
    assert (fresh.email, fresh.email_canonical, fresh.is_active) == ("moved@example.com", "moved@example.com", False)


def test_a_password_change_keeps_an_address_and_active_flag_changed_meanwhile(renter):
    request = RequestFactory().post("/account/password/")
    form = PasswordChangeView.form_class(renter, data={"old_password": PASSWORD, "new_password1": NEW_PASSWORD,
                                                       "new_password2": NEW_PASSWORD}, request=request)
    assert form.is_valid(), form.errors
    _operator_changes_the_account_meanwhile(renter)
    form.save()
    fresh = _after(renter)
    assert (fresh.email, fresh.is_active) == ("moved@example.com", False)


def test_the_admins_own_password_change_keeps_what_changed_meanwhile_too(operator):
    request = RequestFactory().post("/admin/password_change/")
    form = AdminPasswordChangeForm(operator, data={"old_password": PASSWORD, "new_password1": NEW_PASSWORD,
                                                   "new_password2": NEW_PASSWORD}, request=request)
    assert form.is_valid(), form.errors
    _operator_changes_the_account_meanwhile(operator)
    form.save()
    fresh = _after(operator)
    assert (fresh.email, fresh.is_active) == ("moved@example.com", False)
