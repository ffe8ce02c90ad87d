"""No account is deleted in the operators' panel (review r53 #4): a superuser deleting an operator's account took
its audit trail with it (Django's LogEntry.user is CASCADE, AccountStatusChange.by SET_NULL). Deactivate instead."""
import pytest
from django.contrib.admin.models import LogEntry

from marketplace.models import AccountStatusChange, User
from tests.factories import UserFactory
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, offered, staff

pytestmark = pytest.mark.django_db


def test_a_superuser_cannot_delete_an_operator_and_its_audit_trail(operator):
    op = staff("marketplace.change_user", "marketplace.view_user", "marketplace.delete_user")
    renter = UserFactory()
    act(logged_in(op), "marketplace/user", "deactivate_accounts", renter.pk, reason="fraud", index=0)
    assert LogEntry.objects.filter(user=op).count() == 1
    boss = logged_in(operator)
    assert boss.get(f"/admin/marketplace/user/{op.pk}/delete/").status_code == 403
    assert boss.post(f"/admin/marketplace/user/{op.pk}/delete/", {"post": "yes"}).status_code == 403
    act(boss, "marketplace/user", "delete_selected", op.pk, renter.pk, post="yes")
    assert User.objects.filter(pk__in=[op.pk, renter.pk]).count() == 2
    assert LogEntry.objects.filter(user=op).count() == 1
    assert AccountStatusChange.objects.get(user=renter).by_id == op.pk
    assert "delete_selected" not in offered(operator, User)
    assert "deactivate_accounts" in offered(operator, User)  # what stays: deactivating


def test_a_renters_account_is_not_deleted_either(operator, renter):
    boss = logged_in(operator)
    assert boss.post(f"/admin/marketplace/user/{renter.pk}/delete/", {"post": "yes"}).status_code == 403
    assert User.objects.filter(pk=renter.pk).exists()
