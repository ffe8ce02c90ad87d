"""Deactivating and reactivating accounts in the operators' panel: every path goes through
marketplace.services.account_status (found last session: unticking "active" on a user's page saved the flag and
nothing else, so the account's instances kept running and billed with nobody able to stop them, and its servers
stayed on the offers). The page's "active" box and the list's actions, with the reason the owner is told."""
import pytest

from marketplace.models import AccountStatusChange, Instance, InstanceStatus, User
from notifications.models import Notification
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the fixture)
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form
from tests.web.test_admin_permissions import act, staff

# Transactional: the service stops the instances once the admin's transaction commits.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ops(operator):
    return logged_in(operator)


def _running(renter) -> Instance:
    return run(book(renter, make_listed_node(gpu_count=2)))


def _status(instance) -> str:
    return Instance.objects.values_list("status", flat=True).get(pk=instance.pk)


def _deactivated(user) -> bool:
    return not User.objects.get(pk=user.pk).is_active


def test_unticking_active_on_the_page_deactivates_through_the_service(ops, operator, renter):
    instance = _running(renter)
    url = f"/admin/marketplace/user/{renter.pk}/change/"
    data = change_form(ops, url, "user_form")
    assert "status_reason" in data  # the reason's field, under "Active"
    data.pop("is_active")
    data["status_reason"] = ["Chargebacks"]
    r = ops.post(url, data)
    assert r.status_code == 302, r.content.decode()[:2000]
    assert _deactivated(renter)
    # Before: the flag alone; the instance ran on, billed.
    assert _status(instance) == InstanceStatus.STOPPING
    change = AccountStatusChange.objects.get(user=renter)
    assert (change.active, change.by_id, change.reason) == (False, operator.pk, "Chargebacks")
    assert Notification.objects.filter(user=renter, kind="account_deactivated").count() == 1
    assert "Deactivations and reactivations" in ops.get(url).content.decode()  # its history on the page

    data = change_form(ops, url, "user_form")
    data.update(is_active=["on"], status_reason=["Resolved"])
    assert ops.post(url, data).status_code == 302
    assert not _deactivated(renter)
    assert _status(instance) == InstanceStatus.STOPPING  # nothing restarted
    assert list(AccountStatusChange.objects.filter(user=renter).values_list("active", "reason")) == [
        (True, "Resolved"), (False, "Chargebacks")]


def test_saving_the_page_without_touching_active_changes_nothing_of_it(ops, renter):
    instance = _running(renter)
    url = f"/admin/marketplace/user/{renter.pk}/change/"
    assert ops.post(url, change_form(ops, url, "user_form")).status_code == 302
    assert not _deactivated(renter) and _status(instance) == InstanceStatus.RUNNING
    assert not AccountStatusChange.objects.exists()


def test_the_list_actions_deactivate_and_reactivate_through_the_service(ops, operator, renter, stranger):
    mine, theirs = _running(renter), _running(stranger)
    r = act(ops, "marketplace/user", "deactivate_accounts", renter.pk, stranger.pk, operator.pk, reason="Audit")
    assert r.status_code == 302
    assert _deactivated(renter) and _deactivated(stranger)
    assert not _deactivated(operator)  # not one's own
    assert _status(mine) == _status(theirs) == InstanceStatus.STOPPING
    assert set(AccountStatusChange.objects.values_list("user_id", "active", "by_id", "reason")) == {
        (renter.pk, False, operator.pk, "Audit"), (stranger.pk, False, operator.pk, "Audit")}
    # Again: nothing more.
    act(ops, "marketplace/user", "deactivate_accounts", renter.pk, reason="Twice")
    assert AccountStatusChange.objects.filter(user=renter).count() == 1

    act(ops, "marketplace/user", "reactivate_accounts", renter.pk, reason="Cleared")
    assert not _deactivated(renter) and _deactivated(stranger)
    assert _status(mine) == InstanceStatus.STOPPING
    assert Notification.objects.filter(user=renter, kind="account_reactivated").count() == 1


def test_an_operator_cannot_deactivate_their_own_account_nor_a_staff_account_without_being_superuser(ops, operator):
    url = f"/admin/marketplace/user/{operator.pk}/change/"
    data = change_form(ops, url, "user_form")
    assert "is_active" not in data and "status_reason" not in data  # shown, read-only
    assert ops.post(url, data).status_code == 302  # a form without it (unticked) leaves it
    assert not _deactivated(operator)

    support = staff("marketplace.view_user", "marketplace.change_user")
    colleague = UserFactory(is_staff=True)
    act(logged_in(support), "marketplace/user", "deactivate_accounts", colleague.pk, reason="x")
    assert not _deactivated(colleague)
    act(logged_in(staff("marketplace.view_user")), "marketplace/user", "deactivate_accounts",
        UserFactory(email="r@example.com").pk)
    assert not _deactivated(User.objects.get(email="r@example.com"))  # view-only staff run no action
