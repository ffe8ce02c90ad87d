"""The one error system: every ApplicationError the services raise is answered by one rule for the API
(core.api.errors) and one for the pages (core.web_errors).

The classes are found by walking the hierarchy, so a new one fails here until it has a sample below.
"""
import importlib
import pkgutil
from datetime import UTC, datetime, timedelta

import pytest
from django import forms
from django.contrib.messages import get_messages
from django.contrib.messages.storage.fallback import FallbackStorage
from django.contrib.sessions.backends.signed_cookies import SessionStore
from django.test import RequestFactory
from rest_framework.renderers import JSONRenderer, StaticHTMLRenderer
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from billing.services.stripe_gateway import PaymentDeclined
from compat.vast.booking import AskPriceRaised
from core import errors
from core.transitions import InvalidTransition
from core.web_errors import error_message, form_error, message_error
from marketplace.models import User
from marketplace.services.accounts import InvalidSignupToken, SignupPasswordMismatch, TwoFactorRequired
from marketplace.services.disk_room import DiskDoesNotFit, DiskRoom
from marketplace.services.email_verification import EmailNotVerified, InvalidVerificationLink
from marketplace.services.instances import Funds, InsufficientFunds, PriceChanged
from marketplace.services.ssh_keys import InvalidSshKey
from marketplace.services.two_factor import WrongCode, WrongPassword
from provisioning.services.verification import VerifyCooldown

FUNDS = Funds(balance_micros=1_000_000, committed_rate_micros=0, added_rate_micros=2_000_000,
              required_micros=2_000_000, missing_micros=1_000_000, required_s=3600, enforced=True)

# One instance of each class, as the services raise it.
SAMPLES = [
    errors.ApplicationError("Refused."),
    errors.ValidationFailed("Give a positive number.", field="amount"),
    errors.ValidationFailed("The request as a whole is wrong."),
    errors.PermissionDenied("Only operators can do this."),
    errors.NotFound("No such thing."),
    errors.Conflict("The node is retired and cannot be changed."),
    errors.PaymentRequired("Top up first."),
    errors.IdempotencyKeyReused("This Idempotency-Key was already used for a different request."),
    errors.TooManyRequests("No e-mail was sent: as many as an hour allows."),
    errors.UpstreamRefused("The payment provider refused charging your card: no."),
    errors.Unavailable("The payment provider could not be reached; nothing was done.", extra={"top_up": 7}),
    PaymentDeclined("Your card was declined. Nothing was credited.", extra={"top_up": 12}),
    InsufficientFunds("Renting this instance needs one hour ... (POST /api/v1/billing/top-ups/).", FUNDS),
    InvalidSshKey("Paste one public key, e.g. the contents of ~/.ssh/id_ed25519.pub."),
    InvalidSignupToken(),
    SignupPasswordMismatch(),
    TwoFactorRequired(),
    WrongCode(),
    WrongPassword(),
    InvalidTransition("node 5", "retired", "active"),
    EmailNotVerified(User(email="renter@example.com")),
    InvalidVerificationLink(),
    DiskDoesNotFit(7, DiskRoom(reported_gb=200, promised_gb=150, left_gb=50), 80, "an instance disk",
                   "Ask for less disk (disk_gb), or rent another offer.", field="disk_gb"),
    PriceChanged(price_micros=100_000_000, max_price_micros=500_000, unit="GPU-hour"),
    AskPriceRaised("Offer 1201's price has risen since your search: ... Search again.", field="id",
                   extra={"new_ask_id": 10000001201, "dph_total": 40.0, "storage_cost": 0.1}),
    VerifyCooldown(node_id=7, verdict="degraded", finished_at=datetime(2026, 12, 7, 21, 0, tzinfo=UTC),
                   available_at=datetime(2026, 12, 7, 21, 15, tzinfo=UTC),
                   now=datetime(2026, 12, 7, 21, 5, tzinfo=UTC) + timedelta(seconds=30)),
]




def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _every_error_class() -> set[type]:
    """ApplicationError and its subclasses in core and every app's services."""
    for app in ("marketplace", "billing", "provisioning"):
        services = importlib.import_module(f"{app}.services")
        for module in pkgutil.walk_packages(services.__path__, f"{app}.services."):
            importlib.import_module(module.name)
    return {errors.ApplicationError, *_subclasses(errors.ApplicationError)}


# The others take just a message, as ApplicationError does; one that does not fails here until it has a sample.
SAMPLES += [cls("Refused for a reason.") for cls in sorted(_every_error_class() - {type(e) for e in SAMPLES},
                                                             key=lambda c: c.__qualname__)]


def _expected(exc):
    if exc.status_code == 400 and exc.field:
        return {exc.field: [exc.message]}
    return {"detail": exc.message, **exc.extra}


class Refusing(APIView):
    """A view whose service refuses with the error it is given; it would render HTML for a browser."""

    authentication_classes = []
    permission_classes = []
    renderer_classes = [StaticHTMLRenderer, JSONRenderer]
    error = None

    def get(self, request):
        raise self.error


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("accept", ["application/json", "text/html"])
def test_the_api_answers_each_error_with_its_status_and_body(exc, accept):
    request = APIRequestFactory().get("/api/v1/anything/", HTTP_ACCEPT=accept)
    response = Refusing.as_view(error=exc)(request)
    response.render()
    assert response.status_code == exc.status_code
    assert response["Content-Type"] == "application/json"  # whatever the client asked for
    assert response.data == _expected(exc)


def test_the_bodies_are_todays():
    """The shapes the published schema documents: a field's 400, a whole request's error, a failed top-up."""
    assert _expected(InvalidSshKey("Bad key.")) == {"public_key": ["Bad key."]}
    assert _expected(InvalidSignupToken()) == {
        "token": ["This sign-up token is invalid, has expired, or was used already."]}
    assert _expected(errors.Conflict("No.")) == {"detail": "No."}
    assert _expected(errors.ValidationFailed("Wrong.", field="amount")) == {"amount": ["Wrong."]}
    assert _expected(PaymentDeclined("Declined.", extra={"top_up": 3})) == {"detail": "Declined.", "top_up": 3}
    assert (InvalidTransition("node 5", "retired", "active").status_code, InvalidSshKey("x").status_code,
            InsufficientFunds("x", FUNDS).status_code, PaymentDeclined("x").status_code) == (409, 400, 402, 402)


def _page_request():
    request = RequestFactory().post("/")
    request.session = SessionStore()
    request._messages = FallbackStorage(request)
    return request


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
def test_the_pages_show_each_error_as_a_message(exc):
    import marketplace.web.renters  # noqa: F401 (registers the pages' wording of InsufficientFunds)

    request = _page_request()
    message_error(request, exc)
    shown = list(get_messages(request))
    assert [m.level_tag for m in shown] == ["error"]
    shown = [str(m) for m in shown]
    if isinstance(exc, InsufficientFunds):
        assert "/api/" not in shown[0] and "top up at least $1.00" in shown[0]
    else:
        assert shown == [exc.message]


class _Form(forms.Form):
    amount = forms.CharField(required=False)
    public_key = forms.CharField(required=False)


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
def test_the_pages_show_each_error_on_its_field_when_the_form_has_it(exc):
    form = _Form({})
    assert form.is_valid()
    form_error(form, exc)
    on = exc.field if exc.field in form.fields else "__all__"
    assert form.errors == {on: [error_message(exc)]}


def test_a_form_error_without_a_field_can_go_on_the_forms_own_field():
    form = _Form({})
    form.is_valid()
    form_error(form, errors.Conflict("You already added this key."), default_field="public_key")
    form_error(form, InvalidSshKey("Bad key."), default_field="amount")  # its own field first
    assert form.errors == {"public_key": ["You already added this key.", "Bad key."]}


def test_a_rule_checking_several_fields_names_each_in_the_api_and_on_the_form():
    with pytest.raises(errors.ValidationFailed) as raised:
        errors.ValidationFailed.check({"amount": "Too small.", "public_key": "Missing.", "other": "Odd."})
    assert (raised.value.field, raised.value.message) == ("amount", "Too small.")  # the first, for one-line uses
    assert _answer(raised.value) == {"amount": ["Too small."], "public_key": ["Missing."], "other": ["Odd."]}
    form = _Form({})
    form.is_valid()
    form_error(form, raised.value)
    assert form.errors == {"amount": ["Too small."], "public_key": ["Missing."], "__all__": ["Odd."]}
    errors.ValidationFailed.check({})  # no problem: nothing raised


def _answer(exc):
    """What the API answers for `exc` (through a real view and the one exception handler)."""
    response = Refusing.as_view(error=exc)(APIRequestFactory().get("/api/v1/anything/"))
    response.render()
    assert response.status_code == exc.status_code
    return response.data
