"""A page and the API accept and refuse the same input: each rule is defined once, and both use that definition.

For each rule, one table of inputs goes through the API serializer's field and the page form's field; both must
accept it or both refuse it (and the table says which). A copy of a rule that drifts (the top-up form once
took "25.", which the API refuses) fails here.
"""
import pytest
from django import forms
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from billing.api.cards import CardCreateSerializer
from billing.api.top_ups import TopUpCreateSerializer
from billing.api.wallet import ProfileSerializer
from marketplace.api.accounts import ApiKeySerializer, ConfirmSerializer, CredentialsSerializer
from marketplace.api.nodes import NodeCreateSerializer, NodeUpdateSerializer
from marketplace.api.ssh_keys import SshKeySerializer
from marketplace.web import billing_forms, node_forms
from marketplace.web import forms as web_forms

FINGERPRINT = "SHA256:" + "A" * 43
LONG_EMAIL = "a" * 64 + "@" + "b" * 63 + "." + "c" * 63 + "." + "d" * 57 + ".com"  # 254 characters, the most


def _api_accepts(serializer_class, name: str, value) -> bool:
    try:
        serializer_class().fields[name].run_validation(value)
    except serializers.ValidationError:
        return False
    return True


def _page_accepts(form: forms.Form, name: str, value) -> bool:
    try:
        form.fields[name].clean(value)
    except DjangoValidationError:
        return False
    return True


def _top_up_form():
    from tests.factories import UserFactory

    return billing_forms.TopUpForm(user=UserFactory())


# (rule, API serializer, its field, the page's form (a callable), its field, [(input, accepted)])
NAME = [("a" * 100, True), ("a" * 101, False), ("rack 1", True), ("bad\x00name", False), ("tab\there", False),
        ("bell\x07", False), ("C1\x85next line", False), ("ünïcode ✓", True)]
CENTS = [("25", True), ("25.5", True), ("25.00", True), (" 25.00 ", True), ("0025", True), ("25.", False),
         (".5", False), ("25.001", False), ("2.5e1", False), ("1e3", False), ("-25", False), ("+25", False),
         ("25,00", False), ("1,000", False), ("abc", False), ("", False), ("4.99", False), ("5", True),
         ("10000", True), ("10000.01", False), ("NaN", False), ("Infinity", False)]
RULES = [
    ("a node's name", NodeCreateSerializer, "name", node_forms.NodeRegisterForm, "name", NAME + [("", False)]),
    ("a node's city", NodeCreateSerializer, "city", node_forms.NodeRegisterForm, "city", NAME),
    ("a node's datacenter", NodeUpdateSerializer, "datacenter", node_forms.NodeRegisterForm, "datacenter", NAME),
    ("an SSH key's name", SshKeySerializer, "name", lambda: web_forms.SshKeyForm(user=None, request=None),
     "name", NAME + [("", True)]),
    ("an API key's name", ApiKeySerializer, "name", lambda: web_forms.ApiKeyForm(user=None, request=None), "name",
     NAME + [("", True)]),
    ("an address", NodeCreateSerializer, "address", node_forms.NodeRegisterForm, "address",
     [("gpu1.example.com", True), ("203.0.113.9", True), ("2001:db8::1", True), ("-bad.example.com", False),
      ("1.2.3.999", False), ("a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61, True),
      ("a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 62, False), ("under_score.com", False)]),
    ("an SSH port", NodeCreateSerializer, "ssh_port", node_forms.NodeRegisterForm, "ssh_port",
     [("0", False), ("1", True), ("22", True), ("65535", True), ("65536", False), ("-1", False), ("2.5", False)]),
    ("an SSH user", NodeCreateSerializer, "ssh_user", node_forms.NodeRegisterForm, "ssh_user",
     [("root", True), ("_svc-1", True), ("Root", False), ("1user", False), ("a" * 32, True), ("a" * 33, False)]),
    ("a host key fingerprint", NodeCreateSerializer, "host_key_fingerprint", node_forms.NodeRegisterForm,
     "host_key_fingerprint", [(FINGERPRINT, True), (FINGERPRINT[:-1], False), ("MD5:aa:bb", False), ("", True)]),
    ("a node's number of GPUs", NodeCreateSerializer, "gpu_count", node_forms.NodeRegisterForm, "gpu_count",
     [("0", False), ("1", True), ("16", True), ("17", False)]),
    ("a price per GPU-hour", NodeCreateSerializer, "price_per_gpu_hour", node_forms.NodeRegisterForm,
     "price_per_gpu_hour", [("0.001", True), ("0.0009", False), ("100", True), ("100.000001", False),
                            ("0.79", True), ("0.0000001", False), ("-1", False), ("abc", False)]),
    ("a new price per GPU-hour", NodeUpdateSerializer, "price_per_gpu_hour", node_forms.NodeSettingsForm,
     "price_per_gpu_hour", [("0.001", True), ("0.0009", False), ("100", True), ("100.000001", False)]),
    ("a top-up amount", TopUpCreateSerializer, "amount", _top_up_form, "amount", CENTS),
    ("a Stripe Connect account", ProfileSerializer, "stripe_connect_account_id",
     lambda: billing_forms.PayoutAccountForm(user=None, request=None), "stripe_connect_account_id",
     [("acct_1Abc", True), ("", True), ("bank 123", False), ("acct_", False), ("acct_" + "a" * 90, True),
      ("acct_" + "a" * 91, False), ("acct_1-2", False)]),
    ("a SetupIntent id", CardCreateSerializer, "setup_intent", billing_forms.ElementsCardForm, "setup_intent",
     [("seti_1Abc_2", True), ("seti_", False), ("pi_1Abc", False), ("seti_" + "a" * 95, True),
      ("seti_" + "a" * 96, False)]),
    ("an e-mail address", CredentialsSerializer, "email", web_forms.SignupForm, "email",
     [("a@example.com", True), ("not-an-address", False), (LONG_EMAIL, True), (LONG_EMAIL + "m", False)]),
    ("a password's length", CredentialsSerializer, "password", web_forms.SignupForm, "password",
     [("p" * 128, True), ("p" * 129, False)]),
    ("a sign-up token's length", ConfirmSerializer, "token", web_forms.SignupConfirmForm, "token",
     [("t" * 2000, True), ("t" * 2001, False)]),
]


@pytest.mark.django_db
@pytest.mark.parametrize("rule, serializer_class, api_name, make_form, page_name, cases", RULES,
                         ids=[rule[0] for rule in RULES])
def test_the_api_and_the_page_accept_and_refuse_the_same_input(rule, serializer_class, api_name, make_form,
                                                                page_name, cases):
    form = make_form()
    for value, accepted in cases:
        assert _api_accepts(serializer_class, api_name, value) is accepted, (rule, "API", value)
        assert _page_accepts(form, page_name, value) is accepted, (rule, "page", value)


def test_25_dot_is_refused_by_the_top_up_page_and_the_api(web, renter, api):
    """The drift this rule's single definition ended: the page took "25.", the API refused it."""
    from tests.web.test_billing_pages import card_for

    r = web.post("/account/balance/top-up/", {"amount": "25.", "card": card_for(renter).pk, "request_token": "t"})
    assert r.status_code == 400 and 'id="id_amount_errors"' in r.content.decode()
    r = api.post("/api/v1/billing/top-ups/", {"amount": "25.", "card": card_for(api.user, last4="1111").pk},
                 format="json")
    assert r.status_code == 400 and list(r.json()) == ["amount"], r.content


SLICE_PRICES = [("0.001", True), ("0.0009", False), ("100", True), ("100.000001", False), ("0.70", True),
                ("-1", False), ("abc", False), ("", False)]


@pytest.mark.parametrize(("value", "accepted"), SLICE_PRICES)
def test_a_price_per_slice_hour_is_the_apis(value, accepted):
    """The page types a slice price as "<profile>: <price>"; the API takes {profile: price}: one rule for both."""
    assert _api_accepts(NodeUpdateSerializer, "mig_prices", {"3g.40gb": value}) is accepted, ("API", value)
    assert _page_accepts(node_forms.NodeMigForm(), "mig_prices", f"3g.40gb: {value}") is accepted, ("page", value)


def test_a_mig_layout_is_judged_by_the_service_for_both(web, renter, api):
    """Shape aside (JSON or lines), the catalogue's rules are the service's: the same words on the same field."""
    from tests.factories import make_node

    mine, theirs = (make_node(u, gpu_model="a100-80gb-sxm", gpu_count=1) for u in (renter, api.user))
    r = api.patch(f"/api/v1/nodes/{theirs.pk}/", {"mig_layout": [{"gpu": 0, "profiles": ["7g.80gb", "1g.10gb"]}],
                                                   "mig_prices": {"7g.80gb": "1", "1g.10gb": "1"}}, format="json")
    assert r.status_code == 400
    said = r.json()["mig_layout"][0]
    page = web.post(f"/nodes/{mine.pk}/mig/", {"mig_layout": "GPU 0: 7g.80gb, 1g.10gb",
                                               "mig_prices": "7g.80gb: 1\n1g.10gb: 1"}).content.decode()
    assert "overfills" in said and said in page and 'id="id_mig_layout_errors"' in page
