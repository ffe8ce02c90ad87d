"""The operators' panel asks each action's permission: a staff account that may only view a list runs none of its
actions (found by review: every action ran for anyone who could see the list). A superuser runs them all."""
import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from billing.models import AccountKind, LedgerTransaction, Refund, TopUp, TopUpStatus
from billing.services.ledger import credit_grant, user_account, wallet_balance
from marketplace.models import ApiKey, Instance, InstanceStatus, Node, User
from marketplace.services import two_factor
from tests.factories import UserFactory, api_key_for, make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund, logged_in
from tests.web.test_two_factor_pages import enrol

pytestmark = pytest.mark.django_db


def staff(*perms: str) -> User:
    """A staff account holding only the given permissions ("app_label.codename")."""
    user = UserFactory(is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))
    return User.objects.get(pk=user.pk)


def staff_with(*perms: str) -> Client:
    return logged_in(staff(*perms))


def act(client: Client, changelist: str, action: str, *pks, **form):
    return client.post(f"/admin/{changelist}/", {"action": action, "_selected_action": list(pks), **form})


def test_view_only_staff_cannot_turn_off_someones_two_factor(operator):
    # A renter's: a staff account's two-factor is a superuser's to turn off (test_admin_account_security.py).
    victim = UserFactory()
    enrol(victim)
    act(staff_with("marketplace.view_user"), "marketplace/user", "turn_off_two_factor", victim.pk)
    assert two_factor.two_factor_enabled(user=victim), "staff who may only view users turned off a renter's 2FA"
    assert "turn_off_two_factor" not in offered(staff("marketplace.view_user"), User)  # nor offered
    act(staff_with("marketplace.view_user", "marketplace.change_user"), "marketplace/user", "turn_off_two_factor",
        victim.pk)
    assert not two_factor.two_factor_enabled(user=victim)


def test_view_only_staff_cannot_revoke_api_keys(renter):
    api_key_for(renter)
    key = ApiKey.objects.get(user=renter)
    act(staff_with("marketplace.view_apikey"), "marketplace/apikey", "revoke", key.pk)
    key.refresh_from_db()
    assert key.revoked_at is None
    act(staff_with("marketplace.view_apikey", "marketplace.change_apikey"), "marketplace/apikey", "revoke", key.pk)
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_view_only_staff_cannot_unlist_or_service_nodes(stranger):
    node = make_listed_node(stranger, name="n1", gpu_count=1)
    viewer = staff_with("marketplace.view_node")
    assert not offered(staff("marketplace.view_node"), Node)
    for action in ("set_maintenance", "unlist", "reverify_nodes", "accept_new_host_key"):
        act(viewer, "marketplace/node", action, node.pk)
        node.refresh_from_db()
        assert (node.state, node.listed) == ("active", True), action
    act(staff_with("marketplace.view_node", "marketplace.change_node"), "marketplace/node", "unlist", node.pk)
    node.refresh_from_db()
    assert not node.listed


def test_view_only_staff_cannot_force_stop_or_destroy_instances(renter, stranger):
    fund(renter)
    instance = book(renter, make_listed_node(stranger, name="n1", gpu_count=2))
    before = Instance.objects.get(pk=instance.pk).status
    viewer = staff_with("marketplace.view_instance")
    for action in ("force_stop", "force_destroy"):
        act(viewer, "marketplace/instance", action, instance.pk)
        assert Instance.objects.get(pk=instance.pk).status == before, action
    act(staff_with("marketplace.view_instance", "marketplace.change_instance"), "marketplace/instance",
        "force_destroy", instance.pk)
    assert Instance.objects.get(pk=instance.pk).status in (InstanceStatus.DESTROYING, InstanceStatus.DESTROYED)


def test_view_only_staff_cannot_credit_wallets_or_reverse_transactions(renter):
    wallet = user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET)
    credit = {"apply": "1", "amount": "5000", "reason": "because", "customer_note": "", "form_token": "abc123"}
    viewer = staff_with("billing.view_account", "billing.view_ledgertransaction")
    act(viewer, "billing/account", "credit", wallet.pk, **credit)
    assert wallet_balance(user_id=renter.pk) == 0, "view-only staff credited $5000"
    txn, _ = credit_grant(user=renter, amount_micros=5_000_000, reason="r")
    act(viewer, "billing/ledgertransaction", "reverse", txn.pk, apply="1", reason="x", customer_note="")
    assert not LedgerTransaction.objects.filter(reverses=txn).exists()
    # Both post a ledger transaction: the permission to add one lets an operator run them.
    allowed = staff_with("billing.view_account", "billing.view_ledgertransaction", "billing.add_ledgertransaction")
    act(allowed, "billing/ledgertransaction", "reverse", txn.pk, apply="1", reason="x", customer_note="")
    assert LedgerTransaction.objects.filter(reverses=txn).exists()
    act(allowed, "billing/account", "credit", wallet.pk, **credit)
    assert wallet_balance(user_id=renter.pk) == 5_000_000_000


def test_view_only_staff_cannot_refund_top_ups(renter):
    top_up = TopUp.objects.create(user=renter, amount_micros=10_000_000, status=TopUpStatus.PENDING)
    viewer = staff_with("billing.view_topup")
    r = act(viewer, "billing/topup", "refund", top_up.pk)
    assert b"reason" not in r.content  # no form: the action is not theirs (just the list again)
    r = act(staff_with("billing.view_topup", "billing.add_refund"), "billing/topup", "refund", top_up.pk)
    assert r.status_code == 200 and b"reason" in r.content
    assert not Refund.objects.exists()


def offered(user, model) -> set[str]:
    """The actions the admin offers `user` on `model`'s list (and the only ones it runs for them)."""
    from django.contrib import admin
    from django.test import RequestFactory

    request = RequestFactory().get("/admin/")
    request.user = user
    return set(admin.site._registry[model].get_actions(request))


def test_view_only_staff_cannot_process_events_or_send_payouts_again():
    from billing.models import Payout, StripeEvent

    for model, action, perm in ((StripeEvent, "process_again", "billing.change_stripeevent"),
                                (Payout, "send_again", "billing.change_payout")):
        view = f"billing.view_{model._meta.model_name}"
        assert action not in offered(staff(view), model)
        assert action in offered(staff(view, perm), model)


def test_a_superuser_has_every_action(operator):
    from django.contrib import admin

    for model, actions in admin.site._registry.items():
        if model._meta.app_label in ("marketplace", "billing"):
            assert {name for name in offered(operator, model) if name != "delete_selected"} == {
                name for name in (actions.actions or [])}, model
