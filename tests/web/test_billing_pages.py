"""Money pages with Django's test client: balance and top-ups (localstripe where Stripe is reached), cards,
usage, statements, earnings, payouts, the rent page's funds panel, the instance's cost and the servers' earnings.
Permissions (another user's data is invisible or a 404), CSRF, input kept with field errors, nothing written on
bad input."""
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import BillingProfile, Card, LedgerTransaction, Payout, TopUp, TopUpStatus, UsageInterval
from billing.services.ledger import wallet_balance
from billing.services.metering import usage_close
from marketplace.models import Instance
from marketplace.services import volumes as volume_svc
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import book, run
from tests.web.conftest import PASSWORD, fund, logged_in

pytestmark = pytest.mark.django_db

PAGES = ["/account/balance/", "/account/usage/", "/account/statements/", "/earnings/", "/payouts/"]


def card_for(user, last4="4242", pm=None) -> Card:
    return Card.objects.create(user=user, stripe_payment_method_id=pm or f"pm_local_{user.pk}_{last4}",
                               brand="visa", last4=last4, exp_month=12, exp_year=2034)


def used(renter, seconds=600, price="1.200000"):
    """A running instance of `renter` with `seconds` of usage closed through the meter's own service."""
    instance = run(book(renter, make_listed_node(gpu_model="a100-80gb-sxm", price=price, gpu_count=2)))
    instance = Instance.objects.get(pk=instance.pk)
    usage_close(instance=instance, until=instance.started_at + timedelta(seconds=seconds))
    return Instance.objects.get(pk=instance.pk)


# ------------------------------------------------------------------------------------------ access

@pytest.mark.parametrize("url", PAGES + ["/account/statements/2026-03/"])
def test_money_pages_need_a_login(client, url):
    r = client.get(url)
    assert r.status_code == 302 and r["Location"].startswith("/accounts/login/")


def test_the_navigation_links_every_money_page(web, renter):
    """A renter's money pages for everyone signed in; a provider's once they have a server (tests/web/
    test_navigation.py has the rest of the roles)."""
    provider_pages = {"/earnings/", "/payouts/"}
    page = web.get("/").content.decode()
    for url in PAGES:
        assert (f'href="{url}"' in page) == (url not in provider_pages), url
    make_node(renter, name="mine")
    page = web.get("/").content.decode()
    for url in PAGES:
        assert f'href="{url}"' in page, url


@pytest.mark.parametrize("url", ["/account/balance/top-up/", "/account/cards/add/", "/payouts/"])
def test_money_forms_refuse_posts_without_csrf_token(csrf_web, renter, url):
    card = card_for(renter)
    assert csrf_web.post(url, {"amount": "25", "card": card.pk, "payment_method": "pm_card_visa",
                               "stripe_connect_account_id": "acct_1"}).status_code == 403
    assert csrf_web.post(f"/account/cards/{card.pk}/remove/").status_code == 403
    assert TopUp.objects.count() == 0 and Card.objects.count() == 1
    assert not BillingProfile.objects.filter(stripe_connect_account_id="acct_1").exists()


# ----------------------------------------------------------------------------------------- balance

def test_the_balance_page_shows_balance_cards_top_ups_and_notices(web, renter, stranger):
    fund(renter, 100)
    card_for(renter, "4242")
    card_for(stranger, "9999")
    TopUp.objects.create(user=renter, amount_micros=25_000_000, card_label="Visa •••• 4242",
                         status=TopUpStatus.FAILED, failure_message="Your card was declined.")
    TopUp.objects.create(user=stranger, amount_micros=77_000_000, status=TopUpStatus.PROCESSING)
    r = web.get("/account/balance/")
    assert r.status_code == 200 and r["Cache-Control"] == "no-store"
    page = r.content.decode()
    assert re.search(r'id="balance-amount">\$100\.00<', page)
    assert "•••• 4242" in page and "9999" not in page and "$77.00" not in page
    assert "Your card was declined." in page
    # The credit's notice, in the customer's wording (the operator's reason is for operators only: issue 16)
    assert "A credit from the platform." in page and "tests: starting balance" not in page
    assert 'data-poll-stop="1"' in page  # nothing in flight: no polling
    # Test mode (localstripe): Stripe's test cards, not Stripe.js.
    assert 'value="pm_card_visa"' in page and "js.stripe.com" not in page
    assert 'action="/account/balance/top-up/"' in page


def test_stripe_js_is_loaded_only_with_a_real_publishable_key(web, settings):
    assert "js.stripe.com" not in web.get("/account/balance/").content.decode()  # pk_test_local
    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_" + "51Habcdefghijklmnopqrstu"
    page = web.get("/account/balance/").content.decode()
    assert '<script src="https://js.stripe.com/v3/">' in page and 'id="elements-form"' in page
    assert 'data-setup-url="/api/v1/billing/cards/setup-intent/"' in page
    assert 'value="pm_card_visa"' in page  # Stripe's test mode takes its test cards too
    settings.STRIPE_PUBLISHABLE_KEY = "pk_live_" + "51Habcdefghijklmnopqrstu"
    page = web.get("/account/balance/").content.decode()
    assert 'id="elements-form"' in page and "pm_card_visa" not in page
    assert web.post("/account/cards/add/", {"payment_method": "pm_card_visa"}).status_code == 404


def test_the_balance_page_warns_when_the_balance_runs_low(web, renter):
    fund(renter, 1)
    used(renter, seconds=60)  # one GPU at $1.20/h runs: the $0.98 left lasts under an hour
    page = web.get("/account/balance/").content.decode()
    assert "Low balance." in page and "per hour" in page
    BillingProfile.objects.update_or_create(user=renter, defaults={"depleted_at": timezone.now()})
    assert "Your balance ran out" in web.get("/account/balance/").content.decode()


def test_the_balance_page_counts_volumes_and_stopped_disks_in_how_long_the_balance_lasts(web, renter, settings):
    """A renter billed for storage alone is told what it costs and how long the balance lasts, and warned when it
    runs low, as the e-mail warns them (before: "Nothing is running: the balance is not being used")."""
    settings.BILLING_LOW_BALANCE_WARNING_S = 3600
    on = make_listed_node(price="1.000000")
    on.disk_price_per_gb_month_micros = 720_000  # 1,000 micro-dollars per GB-hour
    on.save()
    volume = volume_svc.volume_create(owner=renter, node_id=on.pk, size_gb=500)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    fund(renter, 1)  # $1.00 at $0.50 per hour: 2 h
    for url in ("/account/balance/", "/account/balance/live/"):
        page = web.get(url).content.decode()
        assert "not being used" not in page, url
        assert "Your storage (volumes and stopped instances' disks) costs <strong>$0.50</strong> per hour" in page, url
        assert "lasts about <strong>2 h</strong>" in page and "Low balance." not in page, url
    settings.BILLING_LOW_BALANCE_WARNING_S = 3 * 3600
    page = web.get("/account/balance/").content.decode()
    assert "Low balance." in page and "2 h" in page and "$0.50 per hour" in page
    assert "your volumes and stopped instances are deleted after a grace period" in page
    fund(renter, 10)
    run(book(renter, on))  # GPU time on top: both parts and the sum
    page = web.get("/account/balance/").content.decode()
    assert ("Your running instances cost <strong>$1.00</strong> per hour and your storage (volumes and stopped "
            "instances' disks) <strong>$0.50</strong> per hour, <strong>$1.50</strong> per hour in all: the balance "
            "lasts about <strong>7 h 20 min</strong>") in page


@pytest.mark.parametrize("amount, error", [
    ("4.99", "greater than or equal to 5"), ("10000.01", "less than or equal to 10000"),
    ("25.001", "2 decimal places"), ("abc", "Enter a number"), ("-5", "greater than or equal to 5"),
    ("", "This field is required"), ("1e3", "Enter a number"),
])
def test_bad_top_up_amounts_are_field_errors_kept_in_the_form_and_nothing_is_written(web, renter, amount, error):
    card = card_for(renter)
    r = web.post("/account/balance/top-up/", {"amount": amount, "card": card.pk, "request_token": "t1"})
    assert r.status_code == 400
    page = r.content.decode()
    assert 'id="id_amount_errors"' in page and error in page, page[page.find("id_amount_errors"):][:300]
    assert re.search(r'<input[^>]*name="amount"[^>]*aria-invalid="true"', page)
    if amount:
        assert f'value="{amount}"' in page
    assert not TopUp.objects.exists() and wallet_balance(user_id=renter.pk) == 0


@pytest.fixture
def fleet_node(db):
    from tests.factories import make_listed_node
    return make_listed_node(gpu_count=2)


def test_a_form_token_longer_than_its_key_column_leaves_room_for_is_a_400_not_a_500(web, renter, fleet_node):
    """The pages store their form's token as the idempotency key `web-<token>` in a 100-character column; the
    forms took 100 characters, so a token of 97 to 100 was a DataError, a 500 (found by review)."""
    from core.idempotency import WEB_REQUEST_TOKEN_MAX_LENGTH
    from marketplace.models import Instance
    from tests.marketplace.renting_helpers import ed25519_key
    from tests.web.conftest import fund

    too_long = "t" * (WEB_REQUEST_TOKEN_MAX_LENGTH + 1)
    r = web.post("/account/balance/top-up/", {"amount": "25.00", "card": card_for(renter).pk,
                                              "request_token": too_long})
    assert r.status_code == 400 and "at most 96 characters" in r.content.decode()
    assert not TopUp.objects.exists()
    fund(renter)
    rent = {"image": "pytorch-2-5", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": too_long}
    r = web.post(f"/offers/{fleet_node.pk}/rent/", rent)
    assert r.status_code == 400 and not Instance.objects.exists()
    r = web.post(f"/offers/{fleet_node.pk}/rent/", {**rent, "request_token": too_long[:-1]})
    assert r.status_code == 302 and Instance.objects.get().idempotency_key == "web-" + too_long[:-1]


def test_a_top_up_with_another_users_card_or_none_is_refused(web, renter, stranger):
    theirs = card_for(stranger)
    card_for(renter)
    r = web.post("/account/balance/top-up/", {"amount": "25.00", "card": theirs.pk})
    assert r.status_code == 400 and 'id="id_card_errors"' in r.content.decode()
    assert 'value="25.00"' in r.content.decode()
    assert web.post("/account/balance/top-up/", {"amount": "25.00"}).status_code == 400
    assert not TopUp.objects.exists()


def test_without_a_card_the_page_asks_for_one_first(web):
    page = web.get("/account/balance/").content.decode()
    assert "Save a card below first" in page and 'id="top-up-form"' not in page


def test_an_unreachable_payment_provider_is_explained_and_credits_nothing(web, renter):
    card = card_for(renter)
    r = web.post("/account/balance/top-up/", {"amount": "20.00", "card": card.pk, "request_token": "t2"})
    assert r.status_code == 503
    page = r.content.decode()
    assert "did not answer" in page and "Your card was not charged." in page
    assert 'value="20.00"' in page
    assert 'value="t2"' not in page  # a fresh token: trying again is a new top-up
    assert TopUp.objects.get().status == TopUpStatus.FAILED and wallet_balance(user_id=renter.pk) == 0


def test_the_amount_can_be_suggested_in_the_link(web, renter):
    card_for(renter)
    assert 'value="12"' in web.get("/account/balance/?amount=12").content.decode()
    assert "<script" not in web.get("/account/balance/?amount=<script>").content.decode().split("<main")[1]


def test_cards_are_saved_and_charged_at_localstripe_and_credited_only_by_the_webhook(localstripe, web, renter):
    r = web.post("/account/cards/add/", {"payment_method": "pm_card_visa"})
    assert r.status_code == 302, r.content.decode()[-2000:]
    card = Card.objects.get(user=renter)
    assert (card.brand, card.last4) == ("visa", "4242")
    page = web.get("/account/balance/").content.decode()
    assert "Card Visa •••• 4242 saved." in page
    body = {"amount": "25.00", "card": card.pk, "request_token": "form-1"}
    r = web.post("/account/balance/top-up/", body)
    assert r.status_code == 302 and r["Location"] == "/account/balance/"
    top_up = TopUp.objects.get()
    assert top_up.status == TopUpStatus.PROCESSING and top_up.payment_intent_id
    # Nothing is credited until Stripe's webhook says the payment succeeded (none is delivered here).
    assert wallet_balance(user_id=renter.pk) == 0 and not LedgerTransaction.objects.filter(kind="top_up").exists()
    page = web.get("/account/balance/").content.decode()
    assert "waiting for the payment provider" in page and 'data-poll-stop="1"' not in page
    live = web.get("/account/balance/live/")
    assert "X-Poll-Stop" not in live and 'data-slot="balance"' in live.content.decode()
    # The same form sent again (a double click) charges once.
    assert web.post("/account/balance/top-up/", body).status_code == 302
    assert TopUp.objects.count() == 1


def test_a_declined_card_and_an_unknown_test_card_are_explained(localstripe, web, renter):
    r = web.post("/account/cards/add/", {"payment_method": "pm_card_visa_chargeDeclined"})
    assert r.status_code == 400 and 'id="id_payment_method_errors"' in r.content.decode()
    assert web.post("/account/cards/add/", {"payment_method": "pm_card_chargeCustomerFail"}).status_code == 302
    card = Card.objects.get(user=renter)
    r = web.post("/account/balance/top-up/", {"amount": "50.00", "card": card.pk, "request_token": "x"})
    assert r.status_code == 402
    page = r.content.decode()
    assert "declined" in page and 'value="50.00"' in page
    assert TopUp.objects.get().status == TopUpStatus.FAILED and wallet_balance(user_id=renter.pk) == 0


def test_a_card_is_removed_by_its_owner_only(web, renter, stranger):
    mine, theirs = card_for(renter), card_for(stranger)
    assert web.post(f"/account/cards/{theirs.pk}/remove/").status_code == 404
    assert web.get(f"/account/cards/{mine.pk}/remove/").status_code == 405
    r = web.post(f"/account/cards/{mine.pk}/remove/", follow=True)
    assert r.status_code == 200 and "removed" in r.content.decode()
    assert list(Card.objects.values_list("pk", flat=True)) == [theirs.pk]


def test_a_card_confirmed_by_stripe_elements_is_saved_from_its_setup_intent(localstripe, web, renter, stranger):
    """The page's Elements flow, with the browser's part (Stripe.js confirming the SetupIntent) done by hand."""
    import stripe

    intent = web.post("/api/v1/billing/cards/setup-intent/")  # the page's fetch, with the session's cookie
    assert intent.status_code == 201, intent.content
    seti = intent.json()["setup_intent"]
    stripe.StripeClient("sk_test_x", base_addresses={"api": localstripe.url}).v1.setup_intents.confirm(
        seti, params={"payment_method": "pm_card_visa"})
    assert logged_in(stranger).post("/account/cards/add/", {"setup_intent": seti}).status_code == 400
    r = web.post("/account/cards/add/", {"setup_intent": seti})
    assert r.status_code == 302
    assert list(Card.objects.values_list("user_id", "last4")) == [(renter.pk, "4242")]


def test_an_elements_setup_intent_that_is_malformed_is_refused(web, renter):
    r = web.post("/account/cards/add/", {"setup_intent": "not-a-seti"}, follow=True)
    assert r.status_code == 400 and "could not be saved" in r.content.decode()
    assert not Card.objects.exists()


# ------------------------------------------------------------------------------------------- usage

def test_usage_lists_the_renters_intervals_and_filters_by_instance(web, renter, stranger):
    fund(renter, 50)
    fund(stranger, 50)
    mine = used(renter, seconds=600)
    second = used(renter, seconds=120)
    theirs = used(stranger, seconds=300)
    page = web.get("/account/usage/").content.decode()
    assert f'href="/instances/{mine.pk}/"' in page and f'href="/instances/{second.pk}/"' in page
    assert f'href="/instances/{theirs.pk}/"' not in page
    total = mine.cost_micros + second.cost_micros
    assert f"${total / 1e6:.2f}" in page
    filtered = web.get(f"/account/usage/?instance={mine.pk}")
    page = filtered.content.decode()
    assert filtered.status_code == 200 and f'href="/instances/{second.pk}/"' not in page
    assert re.search(rf'<option value="{mine.pk}" selected>', page)
    for bad in (theirs.pk, "x", 10**12):
        r = web.get(f"/account/usage/?instance={bad}")
        assert r.status_code == 400 and 'id="id_instance_errors"' in r.content.decode()
        assert f'href="/instances/{theirs.pk}/"' not in r.content.decode()


# -------------------------------------------------------------------------------------- statements

def test_statements_by_month_add_up_and_are_private(web, renter, stranger):
    fund(renter, 40)
    instance = used(renter, seconds=3600)  # $1.20
    fund(stranger, 999)
    month = instance.billed_until.strftime("%Y-%m")
    page = web.get("/account/statements/").content.decode()
    assert f'href="/account/statements/{month}/"' in page and "$40.00" in page and "$38.80" in page
    assert "$999" not in page
    detail = web.get(f"/account/statements/{month}/").content.decode()
    assert "$40.00" in detail and "$1.20" in detail and "$38.80" in detail and f"#{instance.pk}" in detail
    assert "$999" not in detail
    for bad in ("2026-13", "1999-01", "march", "2026-3"):
        assert web.get(f"/account/statements/{bad}/").status_code == 404
    assert web.get("/account/statements/\u0662\u0660\u0662\u0666-\u0660\u0663/").status_code == 404  # ASCII only
    empty = web.get("/account/statements/2001-01/")
    assert empty.status_code == 200 and "No usage this month." in empty.content.decode()


# ----------------------------------------------------------------------- renting and instance pages

def test_the_rent_page_shows_the_balance_and_asks_for_a_top_up_when_short(web, renter, settings):
    settings.BILLING_REQUIRE_FUNDS = True
    node = make_listed_node(gpu_model="a100-80gb-sxm", price="1.390000")
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert "Top up first" in page and 'href="/account/balance/?amount=5"' in page and "$1.39 per GPU" in page
    fund(renter, 10)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert "Top up first" not in page and "$10.00" in page


def test_the_instance_page_shows_its_cost_so_far(web, renter, stranger):
    fund(renter, 20)
    instance = used(renter, seconds=1800)  # $0.60 metered
    page = web.get(f"/instances/{instance.pk}/").content.decode()
    cost = re.search(r'id="cost-so-far">Cost so far: <strong>\$([\d.]+)</strong>', page)
    assert cost and float(cost.group(1)) >= 0.60  # plus the seconds since, not metered yet
    assert "30 min 00 s metered" in page
    assert logged_in(stranger).get(f"/instances/{instance.pk}/live/").status_code == 404


# ------------------------------------------------------------------------------------------ providers

def test_earnings_per_server_on_the_earnings_page_and_the_servers_list(client, renter, settings):
    settings.PLATFORM_FEE_PERCENT = 15
    fund(renter, 50)
    instance = used(renter, seconds=3600, price="2.000000")  # $2.00: $1.70 to the provider, $0.30 fee
    provider = instance.node.provider
    web = logged_in(provider)
    nodes = web.get("/nodes/").content.decode()
    assert "Earned" in nodes and "$1.70" in nodes
    page = web.get("/earnings/").content.decode()
    assert "$1.70" in page and "$2.00" in page and "$0.30" in page and f'href="/nodes/{instance.node_id}/"' in page
    assert "No payout account yet" in page
    other = logged_in(UserFactory()).get("/earnings/").content.decode()
    assert "$1.70" not in other and f'href="/nodes/{instance.node_id}/"' not in other


def test_payouts_list_the_providers_own_and_the_account_form_keeps_bad_input(web, renter, stranger):
    assert web.post("/payouts/", {"stripe_connect_account_id": "bank 123"}).status_code == 400
    r = web.post("/payouts/", {"stripe_connect_account_id": "acct_bad!"})
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_stripe_connect_account_id_errors"' in page and 'value="acct_bad!"' in page
    assert not BillingProfile.objects.filter(user=renter).exclude(stripe_connect_account_id="").exists()
    # Where the earnings go needs the password (a session alone, a copied cookie, must not redirect them)
    no = web.post("/payouts/", {"stripe_connect_account_id": "acct_1Test"})
    assert no.status_code == 400 and 'id="id_password_errors"' in no.content.decode()
    no = web.post("/payouts/", {"stripe_connect_account_id": "acct_1Test", "password": "not it"})
    assert no.status_code == 400 and "password was entered incorrectly" in no.content.decode()
    assert not BillingProfile.objects.filter(user=renter).exclude(stripe_connect_account_id="").exists()
    assert web.post("/payouts/", {"stripe_connect_account_id": "acct_1Test", "password": PASSWORD}).status_code == 302
    assert BillingProfile.objects.get(user=renter).stripe_connect_account_id == "acct_1Test"
    assert 'value="acct_1Test"' in web.get("/payouts/").content.decode()
    from billing.models import AccountKind
    from billing.services.ledger import ledger_post, platform_account, user_account

    for user, amount in ((renter, 30_000_000), (stranger, 41_000_000)):
        txn, _ = ledger_post(idempotency_key=f"payout-test-{user.pk}", kind="payout", lines=[
            (user_account(user_id=user.pk, kind=AccountKind.PROVIDER_EARNINGS), -amount),
            (platform_account(kind=AccountKind.PAYOUT_CLEARING), amount)])
        Payout.objects.create(provider=user, period_start="2026-03-02", period_end="2026-03-08",
                              amount_micros=amount, destination="acct_1Test", status="paid", transaction=txn,
                              transfer_id=f"tr_{user.pk}", paid_at=timezone.now())
    page = web.get("/payouts/").content.decode()
    assert "$30.00" in page and "$41.00" not in page and "2026-03-02" in page
    assert UsageInterval.objects.count() == 0
