"""The rent page's Advanced options in a real browser (Playwright, Debian's Chromium) against the live server, a real
Celery worker and a simulated GPU server: a renter runs their own image with env, an on-start script and a port,
SSHes in to read the env, reaches the port the instance page shows, and reads the logs on the page."""
import re
import shutil
import socket

import pytest

from marketplace.models import Instance
from tests.factories import UserFactory
from tests.live import wait_until
from tests.web.conftest import fund
from tests.web.test_browser import log_in, renter_key, settled, shot, shots_dir, ssh, verified_sim_node  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
def test_renter_runs_their_own_image_with_env_onstart_and_a_port(
        worker, live_server, new_page, shot, sim_node_factory, client_for, tmp_path):  # noqa: F811
    provider = UserFactory(email="provider-options@example.com")
    node = verified_sim_node(client_for(provider), sim_node_factory)
    assert settled(node.pk, "active").state == "active", worker.tail()
    renter = UserFactory(email="renter-options@example.com")
    fund(renter)
    key_path, public = renter_key(tmp_path / "renter")
    base = live_server.url
    page = new_page()
    log_in(page, base, renter.email)

    page.goto(f"{base}/offers/{node.pk}/rent/")
    page.get_by_label("Or paste a public key").fill(public)
    assert not page.get_by_label("Your own image").is_visible()  # Advanced starts closed
    page.locator("#advanced summary").click()
    page.get_by_label("Your own image").fill("ghcr.io/acme/notebook:2024.1")
    page.get_by_label("Environment variables").fill("GREETING=hello from the page\nMODE=train")
    page.get_by_label("On-start script").fill('echo "onstart says $GREETING"')
    page.get_by_label("Ports to expose").fill("8888")
    # A bad port first: shown next to the field, the section still open, the rest kept.
    page.get_by_label("Ports to expose").fill("22")
    page.get_by_role("button", name="Rent now").click()
    page.locator("#id_ports_errors").wait_for()
    assert "SSH port" in page.locator("#id_ports_errors").inner_text()
    assert page.get_by_label("Your own image").input_value() == "ghcr.io/acme/notebook:2024.1"
    assert not Instance.objects.filter(renter=renter).exists()
    page.get_by_label("Ports to expose").fill("8888")
    page.get_by_label("Or paste a public key").fill(public)
    shot(page, "rent-advanced")
    page.get_by_role("button", name="Rent now").click()
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    instance = Instance.objects.get(renter=renter)
    assert instance.image_ref == "ghcr.io/acme/notebook:2024.1" and instance.ports_requested == [8888]

    command = page.locator("#ssh-command")
    command.wait_for()
    line = command.inner_text().strip()
    seen = ssh(line, key_path, 'printf "%s" "$GREETING"')
    assert seen.returncode == 0 and seen.stdout == "hello from the page", seen.stderr
    mapped = page.locator("#mapped-ports").inner_text()
    host, port = re.search(r"8888/tcp → (\S+):(\d+)", mapped).groups()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        assert "8888/tcp" in sock.recv(200).decode()
    page.reload()
    assert page.locator("#os").inner_text() and "not known yet" not in page.locator("#os").inner_text()
    assert "ghcr.io/acme/notebook:2024.1" in page.locator("#image").inner_text()

    def logs_show_onstart():
        page.get_by_role("link", name="last 100 lines").click()
        page.locator("#log-lines").wait_for()
        return "onstart says hello from the page" in page.locator("#log-lines").inner_text()

    wait_until(logs_show_onstart, 30, what="the logs to show the onstart output")
    shot(page, "instance-logs")
    assert not page.errors
