"""Who may change what of an account in the operators' panel (found by review: a staff account holding only
view_user and change_user made itself superuser, granted itself any permission, set a superuser's password, and
could change a superuser's address, demote them or turn their two-factor off).

The rules: only a superuser edits is_superuser, is_staff, groups and user_permissions, and a group's permissions
(each grants permissions); only a superuser changes, deletes or turns off the two-factor log-in of a staff account
(superuser or not: a staff account holds permissions its peer may lack, so taking it over by its address or its
password would be the same escalation). Holders of change_user keep managing renters' and providers' accounts."""
import pytest
from django.contrib.auth.models import Group, Permission

from marketplace.models import User
from marketplace.services import two_factor
from tests.factories import UserFactory
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form
from tests.web.test_admin_permissions import act, staff
from tests.web.test_two_factor_pages import enrol

pytestmark = pytest.mark.django_db

NEW_PASSWORD = "Attacker-pass-12345"


def _support():
    """A staff account that manages users, and nothing more."""
    return staff("marketplace.view_user", "marketplace.change_user", "marketplace.delete_user")


def _form(user, **changes) -> dict:
    """The user change form as a browser sends it, with every checkbox of the permissions part on."""
    return {"email": user.email, "is_active": "on", "is_staff": "on", "is_superuser": "on",
            "date_joined_0": "2024-01-01", "date_joined_1": "00:00:00", **changes}


def _perm(label: str) -> Permission:
    app, codename = label.split(".")
    return Permission.objects.get(content_type__app_label=app, codename=codename)


def test_a_staff_account_cannot_make_itself_superuser_nor_grant_itself_permissions():
    me = _support()
    group = Group.objects.create(name="everything")
    group.permissions.add(_perm("billing.add_ledgertransaction"))
    r = logged_in(me).post(f"/admin/marketplace/user/{me.pk}/change/", _form(
        me, user_permissions=[_perm("billing.add_ledgertransaction").pk], groups=[group.pk]))
    assert r.status_code == 403
    me = User.objects.get(pk=me.pk)
    assert not me.is_superuser and not me.groups.exists()
    assert not me.has_perm("billing.add_ledgertransaction")


def test_a_staff_account_edits_an_ordinary_account_but_not_its_permissions(renter):
    group = Group.objects.create(name="ops")
    client = logged_in(_support())
    url = f"/admin/marketplace/user/{renter.pk}/change/"
    r = client.post(url, _form(renter, email="renamed@example.com", groups=[group.pk],
                               user_permissions=[_perm("billing.add_ledgertransaction").pk]))
    assert r.status_code == 302, r.content.decode()[:2000]
    renter = User.objects.get(pk=renter.pk)
    assert renter.email == "renamed@example.com"  # support work goes on
    assert (renter.is_staff, renter.is_superuser) == (False, False)
    assert not renter.groups.exists() and not renter.user_permissions.exists()
    page = client.get(url).content.decode()
    for name in ("is_staff", "is_superuser", "groups", "user_permissions"):
        assert f'name="{name}"' not in page, name  # shown, not editable
    assert 'name="is_active"' in page and 'name="email"' in page


@pytest.mark.parametrize("target", ["superuser", "staff"])
def test_a_staff_account_cannot_change_a_staff_accounts_address_flags_or_delete_it(target):
    other = UserFactory(is_staff=True, is_superuser=target == "superuser")
    other.user_permissions.add(_perm("billing.add_refund"))
    client = logged_in(_support())
    before = User.objects.get(pk=other.pk)
    url = f"/admin/marketplace/user/{other.pk}/change/"
    for change in ({"email": "taken.over@example.com"}, {"is_active": ""}, {"is_superuser": "", "is_staff": ""}):
        assert client.post(url, _form(other, **change)).status_code == 403, change
    page = client.get(url)
    assert page.status_code == 200 and 'name="email"' not in page.content.decode()  # the view-only page
    assert client.post(f"/admin/marketplace/user/{other.pk}/delete/", {"post": "yes"}).status_code == 403
    act(client, "marketplace/user", "delete_selected", other.pk, post="yes")
    after = User.objects.get(pk=other.pk)
    assert (after.email, after.is_active, after.is_staff, after.is_superuser) == (
        before.email, True, True, before.is_superuser)


@pytest.mark.parametrize("target", ["superuser", "staff"])
def test_a_staff_account_cannot_set_a_staff_accounts_password(target):
    other = UserFactory(is_staff=True, is_superuser=target == "superuser")
    before = User.objects.get(pk=other.pk).password
    client = logged_in(_support())
    url = f"/admin/marketplace/user/{other.pk}/password/"
    assert client.get(url).status_code == 403
    r = client.post(url, {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD, "usable_password": "true"})
    assert r.status_code == 403
    assert User.objects.get(pk=other.pk).password == before


def test_a_staff_account_still_sets_an_ordinary_accounts_password(renter, mailoutbox):
    r = logged_in(_support()).post(f"/admin/marketplace/user/{renter.pk}/password/", {
        "password1": NEW_PASSWORD, "password2": NEW_PASSWORD, "usable_password": "true"})
    assert r.status_code == 302
    assert User.objects.get(pk=renter.pk).check_password(NEW_PASSWORD)


def test_two_factor_off_a_staff_account_is_a_superusers_action(operator, renter):
    boss, peer = UserFactory(is_staff=True, is_superuser=True), UserFactory(is_staff=True)
    for user in (boss, peer, renter):
        enrol(user)
    support = logged_in(_support())
    act(support, "marketplace/user", "turn_off_two_factor", boss.pk, peer.pk, renter.pk)
    assert two_factor.two_factor_enabled(user=boss) and two_factor.two_factor_enabled(user=peer)
    assert not two_factor.two_factor_enabled(user=renter)  # a renter who lost both factors is helped
    act(logged_in(operator), "marketplace/user", "turn_off_two_factor", boss.pk, peer.pk)
    assert not two_factor.two_factor_enabled(user=boss) and not two_factor.two_factor_enabled(user=peer)


def test_a_superuser_still_manages_staff_accounts(operator):
    peer = UserFactory(is_staff=True)
    client = logged_in(operator)
    url = f"/admin/marketplace/user/{peer.pk}/change/"
    data = change_form(client, url, "user_form")
    data.update({"is_superuser": ["on"], "user_permissions": [str(_perm("billing.add_refund").pk)]})
    assert client.post(url, data).status_code == 302
    peer = User.objects.get(pk=peer.pk)
    assert peer.is_superuser and peer.user_permissions.filter(codename="add_refund").exists()
    r = client.post(f"/admin/marketplace/user/{peer.pk}/password/", {
        "password1": NEW_PASSWORD, "password2": NEW_PASSWORD, "usable_password": "true"})
    assert r.status_code == 302 and User.objects.get(pk=peer.pk).check_password(NEW_PASSWORD)


def test_a_staff_account_cannot_grant_permissions_through_a_group(operator):
    me = staff("auth.view_group", "auth.change_group", "auth.add_group", "auth.delete_group")
    group = Group.objects.create(name="support")
    me.groups.add(group)
    client = logged_in(me)
    ledger = _perm("billing.add_ledgertransaction")
    url = f"/admin/auth/group/{group.pk}/change/"
    assert client.post(url, {"name": "support", "permissions": [ledger.pk]}).status_code == 403
    assert client.post("/admin/auth/group/add/", {"name": "mine", "permissions": [ledger.pk]}).status_code == 403
    assert client.post(f"/admin/auth/group/{group.pk}/delete/", {"post": "yes"}).status_code == 403
    assert not User.objects.get(pk=me.pk).has_perm("billing.add_ledgertransaction")
    assert not Group.objects.filter(name="mine").exists() and Group.objects.filter(pk=group.pk).exists()
    boss = logged_in(operator)  # a superuser grants
    assert boss.post(url, {"name": "support", "permissions": [ledger.pk]}).status_code == 302
    assert User.objects.get(pk=me.pk).has_perm("billing.add_ledgertransaction")
