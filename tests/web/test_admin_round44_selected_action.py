"""An admin list's action posted with a selected id that is no key of its model (`_selected_action=abc` for an
integer primary key, a number past the column's range, a NUL) was a 500 on every list with an action: Django filters
the list by `pk__in` the posted values as sent, and the field's ValueError (or the database's error) came out of the
action (found by review). The project's site (core/admin_site.py) now reads the selection first, and a post naming
anything that is not a key of the list's model is refused as a whole, a 400 naming the value, no action run."""
import pytest
from django.contrib import admin
from django.test import RequestFactory

from marketplace.models import User
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

NOT_KEYS = ["abc", "1.5", "", "99999999999999999999", "1\x00"]


def _lists_with_actions(user):
    request = RequestFactory().get("/admin/")
    request.user = user
    for model, model_admin in sorted(admin.site._registry.items(), key=lambda item: item[0]._meta.label):
        actions = model_admin.get_actions(request)
        if actions:
            yield f"{model._meta.app_label}/{model._meta.model_name}", next(iter(actions))


def test_every_list_with_an_action_refuses_a_selection_of_no_keys(operator):
    client = logged_in(operator)
    lists = list(_lists_with_actions(operator))
    assert len(lists) >= 8  # users, nodes, instances, API keys, wallets, transactions, top-ups, events, payouts...
    for changelist, action in lists:
        for value in NOT_KEYS:
            for form in ({"index": "0"}, {}):  # the list's Go button, or an action's own confirmation form
                response = client.post(f"/admin/{changelist}/",
                                       {"action": action, "_selected_action": [value], **form})
                assert response.status_code == 400, (changelist, action, value, form, response.status_code)
                assert "Not a key" in response.content.decode(), (changelist, value)


def test_a_selection_with_one_key_that_is_none_runs_nothing(operator, renter):
    response = logged_in(operator).post("/admin/marketplace/user/", {
        "action": "deactivate_accounts", "index": "0", "reason": "fraud", "_selected_action": [renter.pk, "abc"]})
    assert response.status_code == 400
    assert "abc" in response.content.decode()
    assert User.objects.get(pk=renter.pk).is_active  # nothing of the selection was done


def test_a_selection_of_keys_runs_as_before(operator, renter):
    response = logged_in(operator).post("/admin/marketplace/user/", {
        "action": "deactivate_accounts", "index": "0", "reason": "fraud", "_selected_action": [f" {renter.pk}"]})
    assert response.status_code == 302
    assert not User.objects.get(pk=renter.pk).is_active
