"""The notifications API: your list with an unread count and mark-read; your channels per event kind."""
import pytest

from notifications.models import Kind, Preference
from notifications.services.notify import notify

pytestmark = pytest.mark.django_db


def _make(user, n=3):
    return [notify(user=user, kind=Kind.CREDIT_POSTED, payload={"amount": f"{i}.00", "message": f"credit {i}"},
                   dedupe_key=f"c{i}") for i in range(n)]


def test_list_unread_count_and_mark_read(owner_api):
    made = _make(owner_api.user)
    assert owner_api.get("/api/v1/notifications/unread-count/").json() == {"unread": 3}
    listed = owner_api.get("/api/v1/notifications/").json()
    assert [n["id"] for n in listed["results"]] == [n.pk for n in reversed(made)]
    assert listed["results"][0]["title"] == "$2.00 was credited to your balance"
    r = owner_api.post(f"/api/v1/notifications/{made[0].pk}/read/")
    assert r.status_code == 200 and r.json()["read"] is True
    assert owner_api.get("/api/v1/notifications/unread-count/").json() == {"unread": 2}
    assert [n["id"] for n in owner_api.get("/api/v1/notifications/?unread=true").json()["results"]] == [
        made[2].pk, made[1].pk]
    assert [n["id"] for n in owner_api.get("/api/v1/notifications/?unread=false").json()["results"]] == [made[0].pk]
    r = owner_api.get("/api/v1/notifications/?unread=maybe")
    assert r.status_code == 400 and "unread" in r.json()
    assert owner_api.post("/api/v1/notifications/read-all/").json() == {"unread": 0}
    assert owner_api.get("/api/v1/notifications/unread-count/").json() == {"unread": 0}


def test_another_users_notification_is_404_and_hidden(owner_api, other_api):
    made = _make(owner_api.user, 1)[0]
    assert other_api.get(f"/api/v1/notifications/{made.pk}/").status_code == 404
    assert other_api.post(f"/api/v1/notifications/{made.pk}/read/").status_code == 404
    assert other_api.get("/api/v1/notifications/").json()["results"] == []
    other_api.post("/api/v1/notifications/read-all/")
    made.refresh_from_db()
    assert made.read_at is None
    assert other_api.get("/api/v1/notifications/x/").status_code == 404


def test_anonymous_is_401(anon):
    for path in ("/api/v1/notifications/", "/api/v1/webhook-endpoints/", "/api/v1/notification-preferences/"):
        assert anon.get(path).status_code == 401


def test_preferences_list_every_kind_and_set_one(owner_api):
    listed = owner_api.get("/api/v1/notification-preferences/").json()
    # Not the test event, nor an account's deactivation and reactivation (told on every channel: the owner of a
    # deactivated account cannot log in to change a preference).
    assert {p["kind"] for p in listed} == {k.value for k in Kind} - {"test", "account_deactivated",
                                                                      "account_reactivated"}
    assert all(p["in_app"] and p["email"] and p["webhook"] for p in listed)
    r = owner_api.put("/api/v1/notification-preferences/low_balance/",
                      {"in_app": True, "email": False, "webhook": False}, format="json")
    assert r.status_code == 200 and r.json()["email"] is False and r.json()["kind"] == "low_balance"
    assert Preference.objects.get(user=owner_api.user, kind="low_balance").email is False
    r = owner_api.put("/api/v1/notification-preferences/low_balance/", {"in_app": True, "email": "no"},
                      format="json")
    assert r.status_code == 400 and list(r.json()) == ["email"]
    r = owner_api.put("/api/v1/notification-preferences/low_balance/", {"in_app": True, "email": True},
                      format="json")
    assert r.status_code == 400 and list(r.json()) == ["webhook"]
    assert owner_api.put("/api/v1/notification-preferences/test/",
                         {"in_app": True, "email": True, "webhook": True}, format="json").status_code == 404
    r = owner_api.put("/api/v1/notification-preferences/low_balance/",
                      {"in_app": True, "email": True, "webhook": True, "sms": True}, format="json")
    assert r.status_code == 400 and "sms" in r.json()


@pytest.mark.parametrize("path", ["/api/v1/notifications/?unred=true", "/api/v1/notifications/?unread=true&page=1&x=1",
                                  "/api/v1/webhook-endpoints/?active=true", "/api/v1/webhook-deliveries/?endpont=1",
                                  "/api/v1/notification-preferences/?page=2"])
def test_an_unknown_query_parameter_is_a_400_naming_it(owner_api, path):
    """A misspelt filter was ignored: every notification, not the unread ones."""
    r = owner_api.get(path)
    assert r.status_code == 400, r.content
    assert all(body == ["Unknown query parameter."] for body in r.json().values()) and r.json()


def test_a_known_query_parameter_and_the_pages_are_read(owner_api):
    made = _make(owner_api.user, 3)
    body = owner_api.get("/api/v1/notifications/?unread=true&page=1&page_size=2&format=json").json()
    assert (body["count"], len(body["results"])) == (3, 2)
    assert owner_api.get(f"/api/v1/notifications/{made[0].pk}/?unread=true").status_code == 400  # one object
