"""The rule for staff accounts, shared by the operators' pages and the services that enforce it for every caller
(billing.services.refunds: the refunds API and the admin's Refund action alike)."""
from typing import Any


def staff_of_a_non_superuser(operator: Any, user: Any) -> bool:
    """The rule for staff accounts: only a superuser changes one, or what is theirs (their edits, two-factor and API
    keys: marketplace/admin/accounts.py; their instances and nodes; money posted to or from their accounts, refunds
    of their top-ups included: billing/admin.py, billing.services.refunds). Else two non-superuser staff could do for
    each other what neither may do for themselves."""
    return user is not None and (user.is_staff or user.is_superuser) and not operator.is_superuser


STAFF_ACCOUNT_REFUSED = "only a superuser changes a staff account or what is theirs"
