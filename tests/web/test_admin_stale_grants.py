"""A user's or a group's page opened before another superuser revoked a grant (found by review): the groups and
permissions were written back as the page showed them, so a Save made for the address gave back a permission or a
group taken away meanwhile. The page now carries the sets it showed, and the save makes only the operator's own
change to them (what they added, what they took away) to the sets as stored; the operator is told when a set had
moved."""
import pytest
from django.contrib.auth.models import Group, Permission

from marketplace.models import User
from tests.factories import UserFactory
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db


def _perm(label):
    app, codename = label.split(".")
    return Permission.objects.get(content_type__app_label=app, codename=codename)


def _codenames(permissions) -> set[str]:
    return set(permissions.values_list("codename", flat=True))


def test_a_stale_user_page_does_not_give_back_a_permission_revoked_meanwhile(operator):
    ops = logged_in(operator)
    colleague = UserFactory(email="ops2@example.com", is_staff=True)
    colleague.user_permissions.add(_perm("billing.add_ledgertransaction"))
    url = f"/admin/marketplace/user/{colleague.pk}/change/"
    data = change_form(ops, url, "user_form")
    assert data.get("user_permissions")
    colleague.user_permissions.remove(_perm("billing.add_ledgertransaction"))
    data["email"] = ["ops2.new@example.com"]
    r = ops.post(url, data)
    assert not User.objects.get(pk=colleague.pk).has_perm("billing.add_ledgertransaction"), (
        f"the stale page gave the revoked permission back (status {r.status_code})")


def test_a_stale_user_page_does_not_give_back_a_group_removed_meanwhile(operator):
    ops = logged_in(operator)
    finance = Group.objects.create(name="finance")
    finance.permissions.add(_perm("billing.add_refund"))
    colleague = UserFactory(email="ops3@example.com", is_staff=True)
    colleague.groups.add(finance)
    url = f"/admin/marketplace/user/{colleague.pk}/change/"
    data = change_form(ops, url, "user_form")
    assert data.get("groups") == [str(finance.pk)]
    colleague.groups.remove(finance)
    data["email"] = ["ops3.new@example.com"]
    ops.post(url, data)
    assert not User.objects.get(pk=colleague.pk).groups.filter(pk=finance.pk).exists()


def test_a_stale_group_page_does_not_give_back_a_permission_revoked_meanwhile(operator):
    ops = logged_in(operator)
    finance = Group.objects.create(name="finance")
    finance.permissions.add(_perm("billing.add_refund"))
    url = f"/admin/auth/group/{finance.pk}/change/"
    data = change_form(ops, url, "group_form")
    assert data.get("permissions")
    finance.permissions.remove(_perm("billing.add_refund"))
    data["name"] = ["finance team"]
    ops.post(url, data)
    assert not Group.objects.get(pk=finance.pk).permissions.filter(codename="add_refund").exists()


def test_a_change_of_the_permissions_on_a_stale_user_page_is_made_and_nothing_else(operator):
    """The operator adds one permission and takes one away on a page opened before another superuser revoked a third
    and granted a fourth: exactly their change is made, the other's stays, and they are told the set had moved."""
    ops = logged_in(operator)
    colleague = UserFactory(email="ops4@example.com", is_staff=True)
    colleague.user_permissions.add(_perm("billing.add_ledgertransaction"), _perm("billing.add_refund"))
    url = f"/admin/marketplace/user/{colleague.pk}/change/"
    data = change_form(ops, url, "user_form")
    colleague.user_permissions.remove(_perm("billing.add_ledgertransaction"))  # the other superuser's change
    colleague.user_permissions.add(_perm("billing.change_payout"))
    data["user_permissions"] = [str(_perm("billing.add_ledgertransaction").pk),  # kept on the page, as shown
                                str(_perm("marketplace.change_image").pk)]  # added; add_refund taken away
    r = ops.post(url, {**data, "_continue": ["Save and continue editing"]}, follow=True)
    assert r.status_code == 200
    assert _codenames(User.objects.get(pk=colleague.pk).user_permissions) == {"change_payout", "change_image"}
    assert "User permissions: changed by someone else since you opened the page" in r.content.decode()


def test_a_change_of_the_groups_on_a_page_that_is_not_stale_is_made_as_sent(operator):
    ops = logged_in(operator)
    finance, support = Group.objects.create(name="finance"), Group.objects.create(name="support")
    colleague = UserFactory(email="ops5@example.com", is_staff=True)
    colleague.groups.add(finance)
    url = f"/admin/marketplace/user/{colleague.pk}/change/"
    data = change_form(ops, url, "user_form")
    data["groups"] = [str(support.pk)]
    r = ops.post(url, data, follow=True)
    assert r.status_code == 200 and "changed by someone else" not in r.content.decode()
    assert list(User.objects.get(pk=colleague.pk).groups.all()) == [support]
    data = change_form(ops, url, "user_form")  # and taken out of every group: an empty set is sent as such
    data.pop("groups")
    assert ops.post(url, data).status_code == 302
    assert not User.objects.get(pk=colleague.pk).groups.exists()


def test_a_stale_page_with_no_group_shown_does_not_take_away_a_group_given_meanwhile(operator):
    ops = logged_in(operator)
    finance = Group.objects.create(name="finance")
    colleague = UserFactory(email="ops6@example.com", is_staff=True)
    url = f"/admin/marketplace/user/{colleague.pk}/change/"
    data = change_form(ops, url, "user_form")
    assert "groups" not in data and data["initial-groups"] == [""]  # the page's empty set is sent
    colleague.groups.add(finance)
    data["email"] = ["ops6.new@example.com"]
    assert ops.post(url, data).status_code == 302
    stored = User.objects.get(pk=colleague.pk)
    assert stored.email == "ops6.new@example.com" and list(stored.groups.all()) == [finance]


def test_a_change_of_a_groups_permissions_on_a_stale_page_is_made_and_nothing_else(operator):
    ops = logged_in(operator)
    finance = Group.objects.create(name="finance")
    finance.permissions.add(_perm("billing.add_refund"))
    url = f"/admin/auth/group/{finance.pk}/change/"
    data = change_form(ops, url, "group_form")
    finance.permissions.add(_perm("billing.add_ledgertransaction"))  # granted meanwhile
    data["permissions"] = [str(_perm("billing.change_payout").pk)]  # add_refund taken away, change_payout added
    assert ops.post(url, data).status_code == 302
    assert _codenames(Group.objects.get(pk=finance.pk).permissions) == {"add_ledgertransaction", "change_payout"}
