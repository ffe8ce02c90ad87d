"""Each part of the operators' dashboard is shown to those the admin lets view its records, by the admin's own rule:
the view or the change permission (found by review: an operator holding only marketplace.change_node opened the
nodes' list and pages, and the dashboard showed none of the nodes' parts; the same for every part)."""
import pytest

from tests.web.conftest import logged_in
from tests.web.test_admin_dashboard_permissions import SHOWN_BY, dashboard, fleet, staff  # noqa: F401 fleet: fixture

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("perm", list(SHOWN_BY))
def test_each_part_is_shown_to_the_holders_of_its_change_permission_as_its_list_is(fleet, perm):  # noqa: F811
    change = perm.replace(".view_", ".change_")
    user = staff(change)
    app, model = change.split(".change_")
    assert logged_in(user).get(f"/admin/{app}/{model}/").status_code == 200  # the admin's own rule
    page = dashboard(user)
    for marker in SHOWN_BY[perm]:
        assert marker in page, f"{change} opens the list but the dashboard does not show {marker!r}"
    for other, markers in SHOWN_BY.items():
        if other != perm:
            for marker in markers:
                assert marker not in page, f"{change} alone shows {marker!r} (needs {other})"
