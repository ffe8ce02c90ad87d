"""The e-mail a security change sends to the account's address: two-factor on or off, new recovery codes, the
payout account, a saved SSH key, a webhook endpoint. Whoever holds a session (a stolen cookie) must not change
these unseen. Here in core so that every app sends the same words (notifications imports no marketplace
services)."""
import logging
from typing import Protocol
from urllib.parse import urljoin

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse

log = logging.getLogger(__name__)


class Addressee(Protocol):
    email: str


def _send(address: str, subject: str, message: str) -> None:
    try:
        send_mail(f"[{settings.PLATFORM_NAME}] {subject}", message, settings.DEFAULT_FROM_EMAIL, [address])
    except Exception:  # noqa: BLE001 (the answer must not depend on the mail server)
        log.exception("could not send a security e-mail")


def security_change_notify(*, user: Addressee, subject: str, change: str, base_url: str = "") -> None:
    """Tell the account's address that a security setting changed (`change`, a sentence), with the way back if
    it was not its owner. Sent once the caller's transaction commits."""
    reset = (f":\n\n  {urljoin(base_url, reverse('password-reset'))}\n" if base_url
             else " (\"Forgot your password?\" on the log-in page).\n")
    message = (f"{change}\n\nIf it was not you, someone can use your account: reset your password now, which logs "
               f"out every browser, and revoke the API keys you do not recognise{reset}")
    address = user.email
    transaction.on_commit(lambda: _send(address, subject, message))


def operator_change_notify(*, user: Addressee, subject: str, change: str) -> None:
    """Tell the account's address that an operator changed a security setting of theirs in the admin (`change`, a
    sentence: what and what it means for them), as an operator's password, address and two-factor changes are told.
    Not security_change_notify's "if it was not you" wording: it was not them. Sent once the caller's transaction
    commits."""
    message = (f"{change}\n\nIf you do not know why, reply to this e-mail or contact {settings.PLATFORM_NAME}'s "
               "support.\n")
    address = user.email
    transaction.on_commit(lambda: _send(address, subject, message))
