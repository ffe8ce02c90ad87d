"""localstripe, a stateful fake Stripe over real HTTP, started once per test session.

Shared by tests/billing and tests/test_schema.py (any test that reaches Stripe through the platform)."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

LOCALSTRIPE = Path(sys.executable).parent / "localstripe"
SERVE = Path(__file__).resolve().parent.parent / "scripts" / "localstripe-serve"
WEBHOOK_SECRET = "whsec_billing_tests"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalStripe:
    def __init__(self, port: int, proc):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = proc

    def wipe(self):
        requests.delete(f"{self.url}/_config/data", timeout=5).raise_for_status()

    def webhook(self, url: str, secret: str = WEBHOOK_SECRET, name: str = "tests"):
        requests.post(f"{self.url}/_config/webhooks/{name}", data={"url": url, "secret": secret},
                      timeout=5).raise_for_status()


@pytest.fixture(scope="session")
def localstripe_server(tmp_path_factory):
    """localstripe on a free port, its state file in a private temporary folder (it pickles to TMPDIR)."""
    if not LOCALSTRIPE.exists():
        pytest.fail("localstripe is not installed: pip install -r requirements-dev.txt (localstripe==1.15.10)")
    home = tmp_path_factory.mktemp("localstripe")
    port = free_port()
    log = open(home / "localstripe.log", "wb")  # noqa: SIM115 (closed below)
    # scripts/localstripe-serve: localstripe with the payment-intent filters (customer, created) of Stripe.
    proc = subprocess.Popen([sys.executable, str(SERVE), "--port", str(port), "--from-scratch"], cwd=home,
                            env={**os.environ, "TMPDIR": str(home)}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            requests.get(f"http://127.0.0.1:{port}/v1/customers", timeout=1,
                         headers={"Authorization": "Bearer sk_test_x"})
            break
        except requests.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail(f"localstripe did not start: {(home / 'localstripe.log').read_text()[-2000:]}")
            time.sleep(0.1)
    yield LocalStripe(port, proc)
    proc.terminate()
    proc.wait(10)
    log.close()




@pytest.fixture
def localstripe(localstripe_server, settings):
    """localstripe, wiped, with the platform pointed at it (and its webhooks' secret)."""
    localstripe_server.wipe()
    settings.STRIPE_API_BASE = localstripe_server.url
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    return localstripe_server


@pytest.fixture
def stripe_webhooks(localstripe, live_server):
    """localstripe's webhooks delivered to the live test server, for this test only.

    localstripe keeps webhooks across wipes and sends each event a second after it happens: afterwards
    they are pointed at a closed port, so that no later test receives this one's events.
    """
    localstripe.webhook(live_server.url + "/api/v1/billing/stripe/webhook/")
    yield localstripe
    localstripe.webhook("http://127.0.0.1:9/")
