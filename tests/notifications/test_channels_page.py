"""The settings page's channels grid saves what its user changed since the page was shown, and nothing else: each
checkbox carries the value the page showed (a hidden initial value). Before, the posted boxes were compared with the
stored choices, so a choice made meanwhile (the API, another tab) was undone, and a kind the page did not show (one a
deploy added since it was opened) was turned off on every channel, an absent checkbox counting as off (found by
review)."""
import re

import pytest
from django.test import Client

from notifications.models import Kind, Preference
from notifications.services import notify as notify_svc

pytestmark = pytest.mark.django_db

SETTINGS = "/account/notifications/settings/"


@pytest.fixture
def web(owner):
    client = Client()
    client.force_login(owner)
    return client


def _grid(web) -> dict[str, str]:
    """The channels form's fields as a browser posts them: its hidden inputs, and the boxes ticked ("on")."""
    html = web.get(SETTINGS).content.decode()
    form = re.search(r'<form method="post">(.*?)</form>', html, re.S).group(1)
    assert 'name="preferences"' in form
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form))
    fields.pop("csrfmiddlewaretoken", None)
    fields.update({name: "on" for name in re.findall(r'<input type="checkbox" name="([^"]+)"[^>]* checked>', form)})
    return fields


def _channels(owner, kind) -> tuple[bool, bool, bool]:
    p = Preference.objects.filter(user=owner, kind=kind).first()
    return (True, True, True) if p is None else (p.in_app, p.email, p.webhook)


def test_the_grid_saves_the_boxes_changed_on_the_page(web, owner):
    notify_svc.preference_set(user=owner, kind=Kind.NODE_OFFLINE, in_app=True, email=False, webhook=True)
    form = _grid(web)
    assert form["initial-node_offline:email"] == "False" and "node_offline:email" not in form
    del form["payout_sent:email"]  # unticked
    form["node_offline:email"] = "on"  # ticked
    r = web.post(SETTINGS, form, follow=True)
    assert r.redirect_chain == [(SETTINGS, 302)] and b"Your notification settings were saved." in r.content
    assert _channels(owner, Kind.PAYOUT_SENT) == (True, False, True)
    assert _channels(owner, Kind.NODE_OFFLINE) == (True, True, True)
    assert Preference.objects.filter(user=owner).count() == 2  # the kinds not changed got no row
    assert web.post(SETTINGS, _grid(web)).status_code == 302  # saved again unchanged: nothing written
    assert _channels(owner, Kind.PAYOUT_SENT) == (True, False, True)


def test_a_save_from_an_older_page_keeps_a_choice_made_since(web, owner):
    form = _grid(web)
    notify_svc.preference_set(user=owner, kind=Kind.PAYOUT_SENT, in_app=True, email=False, webhook=True)  # the API
    notify_svc.preference_set(user=owner, kind=Kind.NODE_OFFLINE, in_app=False, email=True, webhook=True)
    del form["low_balance:webhook"]
    form["node_offline:email"] = "on"  # shown ticked, still ticked: not a change, whatever is stored now
    assert web.post(SETTINGS, form).status_code == 302
    assert _channels(owner, Kind.PAYOUT_SENT) == (True, False, True)
    assert _channels(owner, Kind.NODE_OFFLINE) == (False, True, True)
    assert _channels(owner, Kind.LOW_BALANCE) == (True, True, False)


def test_a_change_on_the_page_wins_over_one_made_since_on_the_same_box(web, owner):
    form = _grid(web)
    notify_svc.preference_set(user=owner, kind=Kind.LOW_BALANCE, in_app=True, email=True, webhook=False)
    del form["low_balance:email"]
    form.pop("low_balance:webhook")  # shown ticked, unticked on the page too
    web.post(SETTINGS, form)
    assert _channels(owner, Kind.LOW_BALANCE) == (True, False, False)


def test_a_kind_the_page_did_not_show_is_left_as_it_is(web, owner):
    """A kind added by a deploy after the page was opened: its boxes and their shown values are not posted."""
    notify_svc.preference_set(user=owner, kind=Kind.NODE_OFFLINE, in_app=True, email=False, webhook=True)
    form = {k: v for k, v in _grid(web).items() if "low_balance:" not in k and "node_offline:" not in k}
    del form["payout_sent:webhook"]
    assert web.post(SETTINGS, form).status_code == 302
    assert _channels(owner, Kind.LOW_BALANCE) == (True, True, True)  # not turned off: the warning still comes
    assert _channels(owner, Kind.NODE_OFFLINE) == (True, False, True)  # not turned on either
    assert _channels(owner, Kind.PAYOUT_SENT) == (True, True, False)


def test_a_page_from_before_the_shown_values_saves_nothing(web, owner):
    """Posted without any hidden initial value (a page opened before the deploy): nothing is turned off, or on."""
    notify_svc.preference_set(user=owner, kind=Kind.NODE_OFFLINE, in_app=True, email=False, webhook=True)
    form = {k: v for k, v in _grid(web).items() if not k.startswith("initial-")}
    form = {k: v for k, v in form.items() if not k.startswith("low_balance:")}
    form["node_offline:email"] = "on"
    r = web.post(SETTINGS, form)
    assert r.status_code == 400 and b"Nothing was saved: the page was out of date" in r.content
    assert _channels(owner, Kind.LOW_BALANCE) == (True, True, True)
    assert _channels(owner, Kind.NODE_OFFLINE) == (True, False, True)
    assert 'name="initial-low_balance:in_app" value="True"' in r.content.decode()  # the grid again, to save anew


def test_a_shown_value_no_page_shows_counts_as_shown_ticked(web, owner):
    """A hidden initial value is read as a checkbox's: "False" or "0" is unticked, anything else ticked."""
    form = _grid(web)
    form["initial-low_balance:email"] = "garbage"
    del form["low_balance:email"]
    form["initial-payout_sent:email"] = "0"
    assert web.post(SETTINGS, form).status_code == 302
    assert _channels(owner, Kind.LOW_BALANCE) == (True, False, True)
    assert _channels(owner, Kind.PAYOUT_SENT) == (True, True, True)  # shown off, posted on: on, as it was


def test_preference_change_sets_only_the_channels_given(owner):
    from core.errors import ValidationFailed

    p = notify_svc.preference_change(user=owner, kind=Kind.LOW_BALANCE, channels={"email": False})
    assert (p.in_app, p.email, p.webhook) == (True, False, True)
    notify_svc.preference_set(user=owner, kind=Kind.LOW_BALANCE, in_app=False, email=False, webhook=True)
    notify_svc.preference_change(user=owner, kind=Kind.LOW_BALANCE, channels={"webhook": False})
    assert _channels(owner, Kind.LOW_BALANCE) == (False, False, False)
    with pytest.raises(ValidationFailed) as refused:
        notify_svc.preference_change(user=owner, kind=Kind.TEST, channels={"email": False})
    assert refused.value.field == "kind"
    with pytest.raises(ValidationFailed) as refused:
        notify_svc.preference_change(user=owner, kind=Kind.LOW_BALANCE, channels={"sms": False})
    assert refused.value.field == "channels"
