"""A user's page opened before another operator changed the account (found by review): saved for an address edit,
it sent back "active" ticked as it was shown, and the save reactivated the account another operator had just
deactivated and told its owner "Your account is active again". The fields whose change acts or grants (active, the
address, staff, superuser) carry the value the page was opened with; a save that would write over a value changed
since is refused on the form, nothing saved."""
import pytest

from marketplace.models import AccountStatusChange, User
from marketplace.services.account_status import account_deactivate
from notifications.models import Notification
from tests.factories import UserFactory
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops(operator):
    return logged_in(operator)


def _url(user) -> str:
    return f"/admin/marketplace/user/{user.pk}/change/"


def test_a_page_opened_before_a_deactivation_does_not_reactivate_the_account(ops, operator, renter):
    data = change_form(ops, _url(renter), "user_form")
    assert data["is_active"] == ["on"] and data["initial-is_active"] == ["True"]  # the page's value goes with it
    colleague = UserFactory(email="colleague@example.com", is_staff=True, is_superuser=True)
    account_deactivate(user=renter, by=colleague, reason="Chargebacks")
    data["email"] = ["renter.new@example.com"]
    r = ops.post(_url(renter), data)
    assert r.status_code == 200
    assert "Changed by someone else since you opened this page: it is off now." in r.content.decode()
    stored = User.objects.get(pk=renter.pk)
    assert not stored.is_active and stored.email == "renter@example.com"  # nothing saved
    assert list(AccountStatusChange.objects.filter(user=renter).values_list("active", flat=True)) == [False]
    assert not Notification.objects.filter(user=renter, kind="account_reactivated").exists()

    # Opened again: the address is saved, the account stays off.
    data = change_form(ops, _url(renter), "user_form")
    assert "is_active" not in data
    data["email"] = ["renter.new@example.com"]
    assert ops.post(_url(renter), data).status_code == 302
    stored = User.objects.get(pk=renter.pk)
    assert not stored.is_active and stored.email == "renter.new@example.com"


def test_a_stale_page_that_agrees_with_the_change_made_meanwhile_is_saved(ops, renter):
    data = change_form(ops, _url(renter), "user_form")
    account_deactivate(user=renter, by=UserFactory(is_staff=True, is_superuser=True), reason="Audit")
    data.pop("is_active")  # this operator unticked it too: the save writes nothing over the other's change
    data["email"] = ["renter.new@example.com"]
    r = ops.post(_url(renter), data)
    assert r.status_code == 302, r.content.decode()[:2000]
    stored = User.objects.get(pk=renter.pk)
    assert not stored.is_active and stored.email == "renter.new@example.com"
    assert AccountStatusChange.objects.filter(user=renter).count() == 1  # deactivated once, not again


def test_a_stale_page_does_not_give_back_a_staff_status_taken_meanwhile(ops):
    colleague = UserFactory(email="former-ops@example.com", is_staff=True)
    data = change_form(ops, _url(colleague), "user_form")
    assert data["is_staff"] == ["on"]
    User.objects.filter(pk=colleague.pk).update(is_staff=False)  # another superuser's page, saved first
    data["email"] = ["former.ops@example.com"]
    r = ops.post(_url(colleague), data)
    assert r.status_code == 200 and "it is off now" in r.content.decode()
    assert not User.objects.get(pk=colleague.pk).is_staff


def test_a_stale_page_does_not_write_back_an_address_changed_meanwhile(ops, renter):
    data = change_form(ops, _url(renter), "user_form")
    User.objects.filter(pk=renter.pk).update(email="changed.meanwhile@example.com")
    data.pop("is_active")  # and it deactivates, with the address shown when it was opened
    r = ops.post(_url(renter), data)
    assert r.status_code == 200 and "it is “changed.meanwhile@example.com” now" in r.content.decode()
    stored = User.objects.get(pk=renter.pk)
    assert stored.email == "changed.meanwhile@example.com" and stored.is_active
