"""The web pages in a real browser: Playwright drives Debian's Chromium against the live server, with a real
Celery worker and simulated GPU servers (real sshd processes), as a renter, a provider and an operator would.

Screenshots go to $WEB_SCREENSHOTS_DIR when it is set (docs/screenshots/ is made that way:
`WEB_SCREENSHOTS_DIR=docs/screenshots pytest tests/web/test_browser.py`); without it none is taken (`shot` does
nothing): a full-page PNG costs the browser CPU time, and no test looks at one.
"""
import os
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core import mail
from django.db.models import F, Sum
from django.utils import timezone

from billing.models import AccountKind, StripeEvent, TopUp, UsageInterval
from billing.services.ledger import credit_grant, ledger_post, platform_account, user_account, wallet_balance
from marketplace.models import Gpu, Instance, Node, User
from marketplace.templatetags.marketplace_web import usd
from provisioning import sim
from provisioning.models import Job
from tests.factories import UserFactory, make_node
from tests.live import wait_until
from tests.web.conftest import PASSWORD  # the fixtures browser and new_page are there too

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def shots_dir():
    """Where screenshots go: $WEB_SCREENSHOTS_DIR, or None (none is taken)."""
    folder = os.environ.get("WEB_SCREENSHOTS_DIR")
    if not folder:
        return None
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def shot(shots_dir):
    def take(page, name: str, full_page: bool = True):
        if shots_dir is not None:
            page.screenshot(path=str(shots_dir / f"{name}.png"), full_page=full_page)
    return take


def log_in(page, base: str, email: str, password: str = PASSWORD):
    page.goto(f"{base}/accounts/login/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(re.compile(r"^(?!.*/accounts/login/).*$"))


def renter_key(folder: Path):
    key = Ed25519PrivateKey.generate()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "id_ed25519"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return path, public.decode() + " renter@laptop"


def ssh(command_line: str, key_path: Path, remote: str) -> subprocess.CompletedProcess:
    """Run the ssh command the page shows, as a renter pastes it, with their key."""
    argv = command_line.split() + ["-i", str(key_path), "-o", "StrictHostKeyChecking=no", "-o",
                                   "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                                   remote]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def verified_sim_node(client, sim_node_factory, **kwargs) -> Node:
    node, _ = sim_node_factory(client, **kwargs)
    assert client.post(f"/api/v1/nodes/{node.pk}/verify/").status_code == 202
    return node


def _more_of_a_fleet():
    """Rows only (no worker job): a fleet in several states, some GPUs rented, and a job stuck past its deadline,
    so that the dashboard's figures and charts have something to show."""
    other = UserFactory(email="fleet@example.com")
    for model, count, state, rented in [("h100-sxm", 8, "active", 6), ("a100-80gb-sxm", 8, "active", 3),
                                        ("rtx-a6000", 8, "active", 2), ("rtx-4090", 4, "maintenance", 0),
                                        ("rtx-a4000", 2, "offline", 0), ("l40s", 4, "pending", 0)]:
        node = make_node(other, name=f"{state}-{model}", gpu_model=model, gpu_count=count, state=state,
                         verdict="verified" if state != "pending" else "unverified")
        Gpu.objects.filter(node=node, index__lt=rented).update(status="rented")
        if state == "active":
            Node.objects.filter(pk=node.pk).update(score=90.0, reliability=0.99)
    Job.objects.create(kind="node_verify", node=node, status="running", step="benchmarking GPUs 0, 1, 2, 3",
                       deadline=timezone.now() - timedelta(minutes=12))
    # Some money: a renter's credit and an hour of usage charged today, as the meter posts it.
    renter = UserFactory(email="fleet-renter@example.com")
    credit_grant(user=renter, amount_micros=500_000_000, reason="tests: starting balance")
    ledger_post(idempotency_key="fleet-usage", kind="usage", at=timezone.now() - timedelta(microseconds=1), lines=[
        (user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), -74_700_000),
        (user_account(user_id=other.pk, kind=AccountKind.PROVIDER_EARNINGS), 63_495_000),
        (platform_account(kind=AccountKind.PLATFORM_REVENUE), 11_205_000)])


def settled(node_id, state):
    return wait_until(lambda: Node.objects.filter(pk=node_id).exclude(state="verifying").first(), 60,
                      what=f"node {node_id} to be {state}")


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
def test_renter_signs_up_finds_an_a100_rents_connects_and_destroys(
        worker, live_server, stripe_webhooks, settings, new_page, shot, sim_node_factory, client_for, tmp_path):
    settings.BILLING_REQUIRE_FUNDS = True  # renting needs an hour of the price in the balance, as in production
    provider = UserFactory(email="provider@example.com")
    api = client_for(provider)
    a100 = verified_sim_node(api, sim_node_factory, profile="a100-80gb-sxm-x4", gpu_model="a100-80gb-sxm",
                             gpu_count=4, price_per_gpu_hour="1.390000", city="Frankfurt")
    a4000 = verified_sim_node(api, sim_node_factory, profile="rtx-a4000-x2", gpu_model="rtx-a4000", gpu_count=2,
                              price_per_gpu_hour="0.170000", country="PL", city="Warsaw")
    for node in (a100, a4000):
        assert settled(node.pk, "active").state == "active", worker.tail()
    base = live_server.url
    page = new_page()

    # Sign up: the API key is shown once.
    page.goto(f"{base}/accounts/signup/")
    page.get_by_label("Email").fill("renter@example.com")
    page.get_by_label("Password").fill("short")
    page.get_by_role("button", name="Sign up").click()
    assert page.locator("#id_password_errors").is_visible()
    assert page.get_by_label("Email").input_value() == "renter@example.com"  # kept
    page.get_by_label("Password").fill("a long passphrase 42")
    page.get_by_role("button", name="Sign up").click()
    page.get_by_role("heading", name="Check your e-mail").wait_for()
    # The account is made from the link e-mailed to the address (the test settings keep e-mails in memory).
    link = re.search(r"https?://\S+/accounts/confirm/\S+/", mail.outbox[-1].body).group(0)
    page.goto(link)
    page.get_by_label("Password").fill("a long passphrase 42")  # the one chosen at sign-up
    page.get_by_role("button", name="Create my account").click()
    page.get_by_role("heading", name="Welcome").wait_for()
    assert page.locator("#api-key").inner_text().startswith("gpm_")
    renter = User.objects.get(email="renter@example.com")

    # Top up: save one of Stripe's test cards (localstripe here; Stripe Elements with a real key), then charge
    # it. The balance rises only when localstripe's payment_intent.succeeded webhook reaches the live server.
    page.get_by_role("link", name="Add credit").click()
    page.get_by_role("heading", name="Balance", exact=True).wait_for()
    page.get_by_label(re.compile("Visa 4242 — test card")).check()
    page.get_by_role("button", name="Save test card").click()
    page.get_by_text("Card Visa •••• 4242 saved.").wait_for()
    page.get_by_label("Amount (USD)").fill("4.50")
    page.get_by_role("button", name="Top up", exact=True).click()
    assert "greater than or equal to 5" in page.locator("#id_amount_errors").inner_text()
    assert page.get_by_label("Amount (USD)").input_value() == "4.50"  # kept
    page.get_by_label("Amount (USD)").fill("25")
    page.get_by_role("button", name="Top up", exact=True).click()
    page.get_by_text("Payment accepted").wait_for()
    top_up = TopUp.objects.get(user=renter)
    assert top_up.status in ("processing", "succeeded")
    if not StripeEvent.objects.filter(type="payment_intent.succeeded").exists():
        assert wallet_balance(user_id=renter.pk) == 0  # charged, not credited: the webhook has not come yet
    page.locator("#balance-amount", has_text="$25.00").wait_for()  # the page follows it live
    top_up.refresh_from_db()
    event = StripeEvent.objects.get(type="payment_intent.succeeded", status="processed")
    assert top_up.status == "succeeded" and top_up.credited_at >= event.received_at
    assert event.payload["data"]["object"]["metadata"]["top_up_id"] == str(top_up.pk)
    assert wallet_balance(user_id=renter.pk) == 25_000_000
    assert "credited" in page.locator(f"#top-up-{top_up.pk}").inner_text()
    shot(page, "balance")

    # An SSH key for the instance, and an API key for scripts (shown once).
    key_path, public = renter_key(tmp_path / "renter")
    page.goto(f"{base}/account/ssh-keys/")
    page.get_by_label("Name").fill("laptop")
    page.get_by_label("Public key").fill(public)
    page.get_by_label("Password").fill("a long passphrase 42")  # a saved key opens later instances: asked
    page.get_by_role("button", name="Add key").click()
    page.get_by_text("Key “laptop” added").wait_for()
    shot(page, "ssh-keys")
    page.goto(f"{base}/account/api-keys/")
    page.get_by_label("Name").fill("scripts")
    page.get_by_label("Password").fill("a long passphrase 42")  # the password it signed up with
    page.get_by_role("button", name="Create key").click()
    assert page.locator("#new-key").inner_text().startswith("gpm_")
    shot(page, "api-keys")

    # Find an A100 by filtering.
    page.goto(f"{base}/offers/")
    page.get_by_role("heading", name="2 offers").wait_for()
    shot(page, "offers")
    page.get_by_label("A100 80GB SXM", exact=True).check()
    page.get_by_label("At least this many free GPUs").fill("2")
    page.get_by_role("button", name="Show offers").click()
    page.get_by_role("heading", name="1 offer matching").wait_for()
    rows = page.locator("tbody tr")
    assert rows.count() == 1 and "A100 80GB SXM" in rows.first.inner_text() and "Frankfurt" in rows.first.inner_text()
    assert page.get_by_label("A100 80GB SXM", exact=True).is_checked()  # the filters stay as chosen
    shot(page, "offers-filtered")

    # Rent two of its GPUs with a pasted key.
    rows.first.get_by_role("link", name=re.compile("^Rent")).click()
    page.get_by_role("heading", name="Rent A100 80GB SXM").wait_for()
    assert "$25.00" in page.locator("#funds").inner_text() and "Top up first" not in page.content()
    page.get_by_label("PyTorch 2.5.1 (CUDA 12.4, cuDNN 9)").check()
    page.get_by_label("Number of GPUs").fill("2")
    page.get_by_label(re.compile(r"laptop \(SHA256:")).check()
    shot(page, "rent")
    page.get_by_role("button", name="Rent now").click()
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    instance = Instance.objects.get(renter=renter)
    assert instance.node_id == a100.pk and instance.num_gpus == 2

    # The page follows it live until it runs, then shows the ssh command.
    command = page.locator("#ssh-command")
    command.wait_for()
    assert "Running" in page.locator('[data-slot="state"]').inner_text()
    line = command.inner_text().strip()
    assert re.fullmatch(r"ssh -p \d+ \S+@127\.0\.0\.1", line), line
    shot(page, "instance-running")
    seen = ssh(line, key_path, "nvidia-smi --query-gpu=index,name --format=csv,noheader")
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.count("A100-SXM4-80GB") == 2

    page.goto(f"{base}/instances/")
    assert "Running" in page.locator("tbody").inner_text() or "running" in page.locator("tbody").inner_text()
    shot(page, "instances")

    # Destroy it, after confirming (on a phone-sized screen).
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{base}/instances/{instance.pk}/")
    shot(page, "instance-phone", full_page=False)
    page.locator("summary", has_text="Destroy").click()
    page.get_by_role("button", name="Destroy instance").click()
    page.locator('[data-slot="state"]', has_text="Destroyed").wait_for()
    instance.refresh_from_db()
    assert instance.status == "destroyed"
    assert page.get_by_text("Nothing more to do with this instance.").is_visible()
    assert ssh(line, key_path, "true").returncode != 0

    # What it cost: usage by the second, the month's statement, and the provider's earnings.
    page.set_viewport_size({"width": 1280, "height": 900})
    instance.refresh_from_db()
    assert instance.billed_seconds > 0 and instance.cost_micros > 0
    page.goto(f"{base}/account/usage/?instance={instance.pk}")
    assert f"#{instance.pk}" in page.locator("tbody").inner_text()
    shot(page, "usage")
    page.goto(f"{base}/account/statements/")
    shot(page, "statements")
    page.locator("tbody a").first.click()
    page.get_by_role("heading", name=re.compile("^Statement for")).wait_for()
    assert f"#{instance.pk}" in page.locator("main").inner_text()
    shot(page, "statement")
    provider_page = new_page()
    log_in(provider_page, base, "provider@example.com")
    provider_page.goto(f"{base}/earnings/")
    fees = UsageInterval.objects.filter(instance=instance).aggregate(fees=Sum("fee_micros"))["fees"]
    assert usd(instance.cost_micros - fees) in provider_page.locator("#earnings-figures").inner_text()
    shot(provider_page, "earnings")

    # The comparison now has measured figures from the verified servers.
    page.goto(f"{base}/gpus/")
    assert "not measured yet" not in page.locator("table.compare tbody").inner_text().split("Score per GPU")[0]
    shot(page, "gpu-compare")
    # The same pages on a phone.
    phone = new_page(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    phone.goto(f"{base}/offers/")
    assert not phone.locator("details.filters").evaluate("d => d.open")  # results first on a phone
    shot(phone, "offers-phone", full_page=False)
    assert not page.errors and not phone.errors and not provider_page.errors


def test_provider_registers_a_server_and_watches_it_become_verified(
        worker, live_server, new_page, shot, simnodes_dir, settings):
    UserFactory(email="provider@example.com")
    info = sim.node_up("rtx-a6000-x8", simnodes_dir)
    try:
        base = live_server.url
        page = new_page()
        log_in(page, base, "provider@example.com")
        page.goto(f"{base}/nodes/new/")
        page.get_by_label("Name").fill("ams-a6000-01")
        page.get_by_label("Address").fill("not a hostname!")
        page.get_by_label("SSH port").fill(str(info["ssh_port"]))
        page.get_by_label("SSH user").fill(info["ssh_user"])
        page.get_by_label("Host key fingerprint").fill(info["host_key_fingerprint"])
        page.get_by_label("GPU model").select_option("rtx-a6000")
        page.get_by_label("Number of GPUs").fill("8")
        page.get_by_label("Simulated GPU server").check()
        page.get_by_label("Country").select_option("NL")
        page.get_by_label("City").fill("Amsterdam")
        page.get_by_label("Price per GPU-hour (USD)").fill("0.49")
        page.get_by_role("button", name="Register").click()
        assert "neither a hostname nor an IP address" in page.locator("#id_address_errors").inner_text()
        assert page.get_by_label("City").input_value() == "Amsterdam"  # kept
        page.get_by_label("Address").fill(info["address"])
        shot(page, "node-register")
        page.get_by_role("button", name="Register").click()
        page.get_by_role("heading", name="Install the platform's key").wait_for()
        install = page.locator("#install-command").inner_text()
        shot(page, "node-install")

        # On the server: the install command adds the platform's public key for ssh_user.
        public_key = re.search(r"echo '([^']+)'", install).group(1)
        sim.node_authorize(info["ssh_port"], public_key, simnodes_dir)
        page.get_by_role("button", name="Verify now").click()
        page.locator("#node-state", has_text=re.compile("Verifying|Active")).wait_for()
        if page.locator("#current-step").count():
            shot(page, "node-verifying", full_page=False)
        # The steps show while it runs; when the check ends the page reloads with its figures.
        page.get_by_role("heading", name=re.compile("Latest check: verified")).wait_for()
        assert "Active" in page.locator("#node-state").inner_text()
        assert "Verified" in page.locator("#node-verdict").inner_text()
        assert page.locator("svg.chart").count() == 2
        assert "Every check passed" in page.locator("main").inner_text()
        node = Node.objects.get(name="ams-a6000-01")
        assert (node.state, node.verdict) == ("active", "verified")

        page.get_by_label("Price per GPU-hour (USD)").fill("0.45")
        page.get_by_role("button", name="Save").click()
        page.get_by_text("Settings saved.").wait_for()
        node.refresh_from_db()
        assert node.price_per_gpu_hour_micros == 450_000
        # Verify again: an active server stays listed while it is checked, and its history grows. Not within
        # NODE_VERIFY_COOLDOWN_S of the check's verdict (the button says when): that check moved back past it.
        page.locator("#verify-cooldown").wait_for()
        # The disabled button says from when (rounded up to the minute: a click then is never refused).
        assert page.get_by_role("button", name=re.compile(r"^Verify again from \d\d:\d\d UTC$")).is_disabled()
        back = timedelta(seconds=settings.NODE_VERIFY_COOLDOWN_S + 60)
        Job.objects.filter(node=node, kind="node_verify").update(
            created_at=F("created_at") - back, started_at=F("started_at") - back, finished_at=F("finished_at") - back)
        page.reload()
        page.get_by_role("button", name="Verify now").click()
        page.locator("table >> text=verified").nth(1).wait_for()
        assert page.locator("#node-state", has_text="Active").count() == 1
        shot(page, "node-verified")
        page.goto(f"{base}/nodes/")
        assert "ams-a6000-01" in page.locator("tbody").inner_text()
        shot(page, "nodes")
        assert not page.errors
    finally:
        sim.node_down(info["ssh_port"], simnodes_dir)


def test_operator_finds_a_rejected_node_and_its_reasons(
        worker, live_server, new_page, shot, sim_node_factory, client_for):
    provider = UserFactory(email="honest-looking@example.com")
    node = verified_sim_node(client_for(provider), sim_node_factory, profile="a6000-posing-as-a100-x2",
                             gpu_model="a100-80gb-sxm", gpu_count=2, name="cheap-a100")
    assert settled(node.pk, "rejected").state == "rejected", worker.tail()
    UserFactory(email="ops@example.com", is_staff=True, is_superuser=True)
    _more_of_a_fleet()
    base = live_server.url
    page = new_page()
    page.goto(f"{base}/admin/")
    page.get_by_label("Email").fill("ops@example.com")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.get_by_role("heading", name=re.compile("^Fleet")).wait_for()
    rejected = page.locator(".fleet-lists")
    assert "cheap-a100" in rejected.inner_text() and "streaming multiprocessors" in rejected.inner_text()
    revenue = page.locator(".fleet-revenue").inner_text()
    assert "charged to renters" in revenue.lower() and revenue.count("$74.70") == 2 and revenue.count("$11.21") == 2
    shot(page, "admin-dashboard")

    page.get_by_role("link", name=re.compile("nodes rejected")).click()
    page.get_by_role("link", name="cheap-a100").click()
    reasons = page.locator("fieldset", has=page.get_by_role("heading", name="Verification runs"))  # the latest
    text = reasons.inner_text()
    assert "sm_count" in text and "bf16_low" in text and "streaming multiprocessors" in text
    shot(page, "admin-rejected-node")
    # The provider sees the same reasons on their own page.
    provider_page = new_page()
    log_in(provider_page, base, "honest-looking@example.com")
    provider_page.goto(f"{base}/nodes/{node.pk}/")
    assert "Why it was rejected" in provider_page.locator("main").inner_text()
    shot(provider_page, "node-rejected")
    assert not page.errors and not provider_page.errors
