"""A staff account's top-up is a superuser's to refund, on every path (review r53 #1): the admin refused a
non-superuser staff account's refund of another staff account's top-up, but POST /api/v1/billing/refunds/ made it
(201, refunded at Stripe). The rule is now in refund_create_once, so the API, the admin and any other caller get it."""
import pytest
from django.contrib.auth.models import Permission
from django.utils import timezone

from billing.models import Refund, TopUp, TopUpStatus
from billing.services.ledger import credit_grant, wallet_balance
from billing.services.refunds import refund_create
from core.errors import Conflict
from core.staff import STAFF_ACCOUNT_REFUSED
from tests.billing.test_payments import _credited_top_up
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _refunder(**flags):
    operator = UserFactory(is_staff=True, **flags)
    operator.user_permissions.add(Permission.objects.get(content_type__app_label="billing", codename="add_refund"))
    return operator


def _top_up_of(user) -> TopUp:
    """A credited top-up without Stripe (for refusals: nothing reaches Stripe)."""
    paid_in, _ = credit_grant(user=user, amount_micros=40_000_000, reason="stands for the top-up's credit")
    return TopUp.objects.create(user=user, amount_micros=40_000_000, status=TopUpStatus.SUCCEEDED,
                                payment_intent_id=f"pi_staff_rule_{user.pk}", transaction=paid_in,
                                credited_at=timezone.now())


@pytest.mark.parametrize("owner_flags", [{"is_staff": True}, {"is_staff": True, "is_superuser": True}])
def test_the_refunds_api_refuses_a_staff_accounts_top_up_to_a_non_superuser(client_for, owner_flags):
    owner = UserFactory(**owner_flags)
    top_up = _top_up_of(owner)
    response = client_for(_refunder()).post("/api/v1/billing/refunds/",
                                            {"top_up": top_up.pk, "amount": "10.00", "reason": "x"}, format="json")
    assert response.status_code == 409, response.content
    assert STAFF_ACCOUNT_REFUSED in response.json()["detail"]
    assert not Refund.objects.exists()
    assert wallet_balance(user_id=owner.pk) == 40_000_000  # nothing held


def test_the_refund_service_refuses_it_for_any_caller():
    top_up = _top_up_of(UserFactory(is_staff=True))
    with pytest.raises(Conflict) as refused:
        refund_create(top_up=top_up, amount_micros=10_000_000, reason="x", created_by=_refunder())
    assert STAFF_ACCOUNT_REFUSED in refused.value.message
    assert not Refund.objects.exists()


def test_a_superuser_refunds_a_staff_accounts_top_up_and_other_staff_a_customers(localstripe, client_for):
    owner = UserFactory(is_staff=True)
    top_up = _credited_top_up(localstripe, client_for(owner))
    response = client_for(_refunder(is_superuser=True)).post(
        "/api/v1/billing/refunds/", {"top_up": top_up.pk, "amount": "10.00", "reason": "x"}, format="json")
    assert response.status_code == 201, response.content
    assert wallet_balance(user_id=owner.pk) == 30_000_000
    # A customer's (not staff) top-up stays any refunder's to refund.
    customer_top_up = _credited_top_up(localstripe, client_for(UserFactory()))
    response = client_for(_refunder()).post(
        "/api/v1/billing/refunds/", {"top_up": customer_top_up.pk, "amount": "5.00", "reason": "x"}, format="json")
    assert response.status_code == 201, response.content
