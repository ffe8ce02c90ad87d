"""Only a superuser changes a staff account, or what is theirs: the users' pages applied it (edits, two-factor, API
keys), the money actions and the instances' and nodes' actions did not (found by review). A non-superuser staff
member holding billing.add_ledgertransaction credited a staff colleague's wallet ($100,000 a form), and one with
change_instance or change_node destroyed a superuser's instances or retired a staff member's nodes. Each is now
refused with a message naming the rule, nothing done; an ordinary user's, and a superuser's action, still go."""
import pytest
from django.contrib.auth.models import Permission

from billing.models import AccountKind, BillingProfile, LedgerTransaction
from billing.services.ledger import credit_grant, user_account, wallet_balance
from marketplace.models import Instance, NodeState, User
from tests.billing.test_disputes import credited_top_up
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund, logged_in

pytestmark = pytest.mark.django_db

RULE = "only a superuser changes a staff account or what is theirs"


def _staff(*codenames: str) -> User:
    """A non-superuser staff member holding the permissions named (app_label.codename)."""
    user = UserFactory(is_staff=True)
    for name in codenames:
        app_label, codename = name.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    return User.objects.get(pk=user.pk)  # the permissions' cache read afresh


def _credit(by: User, wallet_owner: User, token: str):
    wallet = user_account(user_id=wallet_owner.pk, kind=AccountKind.CUSTOMER_WALLET)
    return logged_in(by).post("/admin/billing/account/", {
        "action": "credit", "_selected_action": [wallet.pk], "apply": "1", "amount": "100000", "reason": "r",
        "customer_note": "", "form_token": token})


def test_a_non_superuser_credits_no_staff_wallet(operator):
    alice = _staff("billing.add_ledgertransaction", "billing.view_account")
    bob, customer = _staff(), UserFactory()
    refused = _credit(alice, bob, "tok1")
    assert refused.status_code == 400 and RULE in refused.content.decode()
    assert wallet_balance(user_id=bob.pk) == 0  # nothing posted
    assert _credit(alice, operator, "tok2").status_code == 400  # nor a superuser's
    assert wallet_balance(user_id=operator.pk) == 0
    assert _credit(alice, customer, "tok3").status_code == 302  # an ordinary customer's: credited
    assert wallet_balance(user_id=customer.pk) == 100_000_000_000
    assert _credit(operator, bob, "tok4").status_code == 302  # a superuser credits a staff wallet
    assert wallet_balance(user_id=bob.pk) == 100_000_000_000


def test_a_non_superuser_reverses_nothing_of_a_staff_account(operator):
    alice = _staff("billing.add_ledgertransaction", "billing.view_ledgertransaction")
    bob = _staff()
    txn, _ = credit_grant(user=bob, amount_micros=5_000_000, reason="r", customer_note="", created_by=operator,
                          idempotency_key="t-staff")
    refused = logged_in(alice).post("/admin/billing/ledgertransaction/", {
        "action": "reverse", "_selected_action": [txn.pk], "apply": "1", "reason": "r", "customer_note": ""})
    assert refused.status_code == 400 and RULE in refused.content.decode()
    assert wallet_balance(user_id=bob.pk) == 5_000_000 and not LedgerTransaction.objects.filter(reverses=txn).exists()


def test_a_non_superuser_refunds_no_staff_top_up():
    alice = _staff("billing.add_refund", "billing.view_topup")
    bob = _staff()
    top_up = credited_top_up(bob, 10_000_000)
    refused = logged_in(alice).post("/admin/billing/topup/", {
        "action": "refund", "_selected_action": [top_up.pk], "apply": "1", "amount": "5.00", "reason": "r",
        "customer_note": "", "form_token": "t1"})
    assert refused.status_code == 400 and RULE in refused.content.decode()
    assert not top_up.refunds.exists()


def test_a_non_superuser_sets_no_staff_payout_account():
    alice = _staff("billing.change_billingprofile", "billing.view_billingprofile")
    bob = _staff()
    profile = BillingProfile.objects.get_or_create(user=bob)[0]
    page = logged_in(alice).post(f"/admin/billing/billingprofile/{profile.pk}/change/",
                                 {"stripe_connect_account_id": "acct_1234567890abcdef"})
    assert page.status_code == 403  # view only: no form to send
    profile.refresh_from_db()
    assert profile.stripe_connect_account_id in ("", None)


def test_a_non_superuser_stops_or_destroys_no_staff_members_instance(operator):
    alice = _staff("marketplace.change_instance", "marketplace.view_instance")
    renter = UserFactory()
    for owner in (operator, _staff(), renter):
        fund(owner)
    theirs = [book(owner, make_listed_node(gpu_count=1)) for owner in (operator, renter)]
    Instance.objects.filter(pk__in=[i.pk for i in theirs]).update(status="running")
    client = logged_in(alice)
    client.post("/admin/marketplace/instance/", {"action": "force_destroy",
                                                 "_selected_action": [i.pk for i in theirs]})
    superusers, renters = (Instance.objects.get(pk=i.pk).status for i in theirs)
    assert superusers == "running" and renters == "destroying"


def test_a_non_superuser_retires_no_staff_members_node(operator):
    alice = _staff("marketplace.change_node", "marketplace.view_node")
    staff_node, node = make_listed_node(_staff(), gpu_count=1), make_listed_node(UserFactory(), gpu_count=1)
    response = logged_in(alice).post("/admin/marketplace/node/", {"action": "retire",
                                                                  "_selected_action": [staff_node.pk, node.pk]},
                                     follow=True)
    assert RULE in response.content.decode()
    staff_node.refresh_from_db(), node.refresh_from_db()
    assert staff_node.state != NodeState.RETIRED and node.state == NodeState.RETIRED
    logged_in(operator).post("/admin/marketplace/node/", {"action": "retire", "_selected_action": [staff_node.pk]})
    staff_node.refresh_from_db()
    assert staff_node.state == NodeState.RETIRED  # a superuser's to do
