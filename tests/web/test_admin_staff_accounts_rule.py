"""Only a superuser changes a staff account, or what is theirs: the users' pages applied it (edits, two-factor, API
keys), the money actions and the instances' and nodes' actions did not (found by review). A non-superuser staff
member holding billing.add_ledgertransaction credited a staff colleague's wallet ($100,000 a form), and one with
change_instance or change_node destroyed a superuser's instances or retired a staff member's nodes. Each is now
refused with a message naming the rule, nothing done; an ordinary user's, and a superuser's action, still go."""
import pytest
from django.contrib.auth.models import Permission

from billing.models import AccountKind, BillingProfile, LedgerTransaction
from billing.services.ledger import credit_grant, user_account, wallet_balance
from marketplace.models import Gpu, GpuStatus, Instance, NodeState, User
from tests.billing.test_disputes import credited_top_up
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund, logged_in
from tests.web.test_admin_pages import change_form

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


def _set_gpu(by: User, gpu: Gpu, status: str) -> int:
    client = logged_in(by)
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    data = change_form(client, url, "gpu_form")
    data["status"] = [status]
    return client.post(url, data).status_code


def test_a_non_superuser_takes_no_gpu_of_a_staff_members_node_out_of_service(operator):
    """The GPU's own page: a staff account's (or a superuser's) node keeps its GPUs on the offers; an ordinary
    provider's GPU is still taken out, and a superuser takes out a staff member's."""
    alice = _staff("marketplace.change_gpu", "marketplace.view_gpu")
    theirs = [Gpu.objects.get(node=make_listed_node(owner, gpu_count=1)) for owner in (operator, _staff())]
    for gpu in theirs:
        assert _set_gpu(alice, gpu, "unavailable") == 403  # view only: no form to send
        assert Gpu.objects.get(pk=gpu.pk).status == GpuStatus.FREE, "a non-superuser took a staff member's GPU out"
    providers = Gpu.objects.get(node=make_listed_node(UserFactory(), gpu_count=1))
    assert _set_gpu(alice, providers, "unavailable") == 302
    assert Gpu.objects.get(pk=providers.pk).status == GpuStatus.UNAVAILABLE
    assert _set_gpu(operator, theirs[1], "unavailable") == 302  # a superuser's to do
    assert Gpu.objects.get(pk=theirs[1].pk).status == GpuStatus.UNAVAILABLE


def _gpus_unavailable_on_the_node_page(by: User, node) -> int:
    client = logged_in(by)
    url = f"/admin/marketplace/node/{node.pk}/change/"
    data = change_form(client, url, "node_form")
    for row in range(int(data["gpus-TOTAL_FORMS"][0])):  # sent for every row, whether the page offered it or not
        data[f"gpus-{row}-status"] = ["unavailable"]
    return client.post(url, data).status_code


def test_a_non_superuser_takes_no_gpu_out_through_a_staff_members_node_page(operator):
    """The node's page: its GPU rows are read-only to a non-superuser when the node is a staff account's; what the
    page posts for them anyway is not saved."""
    alice = _staff("marketplace.change_node", "marketplace.view_node", "marketplace.change_gpu")
    for owner in (operator, _staff()):
        node = make_listed_node(owner, gpu_count=2)
        assert _gpus_unavailable_on_the_node_page(alice, node) == 302
        assert list(Gpu.objects.filter(node=node).values_list("status", flat=True)) == ["free", "free"]
    providers = make_listed_node(UserFactory(), gpu_count=2)
    assert _gpus_unavailable_on_the_node_page(alice, providers) == 302
    assert set(Gpu.objects.filter(node=providers).values_list("status", flat=True)) == {"unavailable"}
    staff_node = make_listed_node(_staff(), gpu_count=2)
    assert _gpus_unavailable_on_the_node_page(operator, staff_node) == 302  # a superuser's to do
    assert set(Gpu.objects.filter(node=staff_node).values_list("status", flat=True)) == {"unavailable"}
