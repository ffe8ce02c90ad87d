"""A user's page wrote back what the system writes (found by review): "last login" and "date joined" were editable
fields of the page, so a Save made for the address wrote the last log-in the page had shown over one made while it
was open; and the save wrote the whole row as read when the form was sent, so a change the account's owner
committed meanwhile (a new password, the sessions ended by turning two-factor on, the address proved) was undone by
it. The two dates are now read-only on the page, and a Save writes only the columns the operator changed."""
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.hashers import make_password
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace.admin import UserAdmin
from marketplace.models import User
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops(operator):
    return logged_in(operator)


def _url(user) -> str:
    return f"/admin/marketplace/user/{user.pk}/change/"


def test_a_log_in_made_while_the_page_was_open_survives_its_save(ops, renter):
    shown = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    User.objects.filter(pk=renter.pk).update(last_login=shown)
    data = change_form(ops, _url(renter), "user_form")
    logged_in_now = timezone.now().replace(microsecond=0)
    User.objects.filter(pk=renter.pk).update(last_login=logged_in_now)  # the owner logs in meanwhile
    data["email"] = ["renter.new@example.com"]
    data.update({"last_login_0": ["2026-01-02"], "last_login_1": ["03:04:05"]})  # as an editable page sent it
    r = ops.post(_url(renter), data)
    assert r.status_code == 302, r.content.decode()[:2000]
    stored = User.objects.get(pk=renter.pk)
    assert stored.email == "renter.new@example.com"
    assert stored.last_login == logged_in_now


def test_the_dates_are_shown_not_posted(ops, renter):
    joined = User.objects.get(pk=renter.pk).date_joined
    data = change_form(ops, _url(renter), "user_form")
    assert not {"last_login_0", "last_login_1", "date_joined_0", "date_joined_1"} & set(data)
    data.update({"date_joined_0": ["2001-01-01"], "date_joined_1": ["00:00:00"],
                 "last_login_0": ["2001-01-01"], "last_login_1": ["00:00:00"]})  # a hand-made post
    assert ops.post(_url(renter), data).status_code == 302
    stored = User.objects.get(pk=renter.pk)
    assert stored.date_joined == joined and stored.last_login is None


def test_the_owners_changes_committed_during_the_save_survive_it(ops, renter, monkeypatch):
    """The row is read when the form is sent and written after its checks: what the owner commits in between (a new
    password, the other sessions ended, a log-in) is not the operator's to write back."""
    data = change_form(ops, _url(renter), "user_form")
    new_hash = make_password("a new password of the owner's")
    read = UserAdmin.get_object

    def read_then_the_owner_commits(self, request, object_id, from_field=None):
        obj = read(self, request, object_id, from_field)
        if request.method == "POST":
            User.objects.filter(pk=obj.pk).update(password=new_hash, sessions_epoch=F("sessions_epoch") + 1,
                                                  last_login=timezone.now() - timedelta(seconds=1))
        return obj

    monkeypatch.setattr(UserAdmin, "get_object", read_then_the_owner_commits)
    data["email"] = ["renter.new@example.com"]
    assert ops.post(_url(renter), data).status_code == 302
    stored = User.objects.get(pk=renter.pk)
    assert stored.email == "renter.new@example.com" and stored.email_verified_at is None
    assert stored.password == new_hash and stored.sessions_epoch == 1 and stored.last_login is not None


def test_a_save_that_changed_nothing_writes_nothing(ops, renter):
    data = change_form(ops, _url(renter), "user_form")
    with CaptureQueriesContext(connection) as queries:
        assert ops.post(_url(renter), data).status_code == 302
    table = f'"{User._meta.db_table}"'
    assert not [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"UPDATE {table}")]


def test_a_password_set_by_an_operator_writes_the_password_alone(ops, renter, monkeypatch):
    """The "set password" page read the account, hashed the new password (the slow step) and wrote the whole row:
    a log-in or the address proved by its owner meanwhile was written back as read."""
    hash_password = User.set_password
    proved = timezone.now().replace(microsecond=0)

    def hash_while_the_owner_logs_in(user, raw_password):
        hash_password(user, raw_password)
        User.objects.filter(pk=user.pk).update(last_login=proved, email_verified_at=proved)

    User.objects.filter(pk=renter.pk).update(email_verified_at=None)
    monkeypatch.setattr(User, "set_password", hash_while_the_owner_logs_in)
    r = ops.post(f"/admin/marketplace/user/{renter.pk}/password/", {
        "password1": "An operator's new password 42", "password2": "An operator's new password 42",
        "usable_password": "true"})
    assert r.status_code == 302, r.content.decode()[:3000]
    stored = User.objects.get(pk=renter.pk)
    assert stored.check_password("An operator's new password 42")
    assert stored.last_login == proved and stored.email_verified_at == proved
