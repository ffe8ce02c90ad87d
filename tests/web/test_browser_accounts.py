"""Accounts in a real browser (Playwright with Debian's Chromium against the live server): a forgotten password
reset end to end through the file e-mail backend, as the demo delivers mail (var/mail/)."""
import re

import pytest

from tests.factories import UserFactory
from tests.web.conftest import PASSWORD  # the fixtures browser and new_page are there too
from tests.web.test_browser import log_in

pytestmark = pytest.mark.slow

NEW_PASSWORD = "a brand new passphrase 77"


def _only_link(folder) -> str:
    files = sorted(folder.glob("*.log"))
    assert len(files) == 1, files
    text = files[0].read_text()
    assert "Subject: [gpumarket] Reset your password" in text and "To: forgetful@example.com" in text
    return re.search(r"https?://\S+/accounts/password/reset/\S+/\S+/", text).group(0)


def test_a_forgotten_password_is_reset_through_the_e_mail(live_server, settings, tmp_path, new_page):
    settings.EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
    settings.EMAIL_FILE_PATH = str(tmp_path / "mail")
    UserFactory(email="forgetful@example.com")
    base = live_server.url

    # A browser that stays logged in with the old password: the reset logs it out.
    other = new_page()
    log_in(other, base, "forgetful@example.com")

    page = new_page()
    page.goto(f"{base}/accounts/login/")
    page.get_by_role("link", name="Forgot your password?").click()
    page.get_by_label("Email").fill("forgetful@example.com")
    page.get_by_role("button", name="Send the link").click()
    page.get_by_role("heading", name="Check your e-mail").wait_for()
    assert page.url.endswith("/accounts/password/reset/sent/")

    link = _only_link(tmp_path / "mail")
    page.goto(link)
    page.get_by_role("heading", name="Choose a new password").wait_for()
    page.get_by_label("New password", exact=True).fill(NEW_PASSWORD)
    page.get_by_label("New password confirmation").fill(NEW_PASSWORD + "?")
    page.get_by_role("button", name="Save the new password").click()
    assert page.get_by_text("The two password fields didn’t match.").is_visible()
    page.get_by_label("New password", exact=True).fill(NEW_PASSWORD)
    page.get_by_label("New password confirmation").fill(NEW_PASSWORD)
    page.get_by_role("button", name="Save the new password").click()
    page.get_by_role("heading", name="Password saved").wait_for()

    page.get_by_role("link", name="Log in").last.click()
    page.get_by_label("Email").fill("forgetful@example.com")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    assert page.get_by_text("Please enter a correct email address and password.").is_visible()
    log_in(page, base, "forgetful@example.com", NEW_PASSWORD)
    page.goto(f"{base}/account/security/")
    assert page.get_by_role("heading", name="Security").is_visible()

    other.goto(f"{base}/account/security/")
    assert "/accounts/login/" in other.url  # the session from before the reset has ended

    page.goto(link)  # the link worked once
    page.get_by_role("heading", name="This link does not work").wait_for()
    assert not page.errors and not other.errors
