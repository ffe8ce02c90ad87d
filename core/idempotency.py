"""What makes a retried create safe: the Idempotency-Key a client sends and the body it sent with it.

Shared by every create that may be retried (instances, top-ups, volumes). The services store the key and the
body's fingerprint under a unique constraint; the same key with another body is refused.
"""
import hashlib
import json
import re
from collections.abc import Callable
from typing import TypeVar

from django.db import IntegrityError

from core.errors import ApplicationError

T = TypeVar("T")

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_MAX_LENGTH = 100  # the columns that store it (Instance, TopUp, Volume) hold as many
IDEMPOTENCY_KEY_RE = re.compile(rf"[\x21-\x7e]{{1,{IDEMPOTENCY_KEY_MAX_LENGTH}}}")  # printable ASCII
# A page's form carries its own token (a double submission books or charges once): stored with this prefix, so
# that it never meets an API client's key; the token is as long as the column leaves room for.
WEB_KEY_PREFIX = "web-"
WEB_REQUEST_TOKEN_MAX_LENGTH = IDEMPOTENCY_KEY_MAX_LENGTH - len(WEB_KEY_PREFIX)


def web_idempotency_key(token: str) -> str:
    """The idempotency key of a page's form token ('' for none)."""
    return WEB_KEY_PREFIX + token if token else ""


def request_fingerprint(data: object) -> str:
    """SHA-256 of the body in a canonical form: key order and spacing do not change it."""
    if hasattr(data, "lists"):  # a QueryDict (form data): every value is a list
        data = dict(data.lists())
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_once(key: str, earlier: Callable[[], T | None], create: Callable[[], T]) -> tuple[T, bool]:
    """(what `key` made before, False) when `earlier` finds it, else (create(), True); no key: create() alone.

    `earlier` is asked again when the create fails: on the key's unique index (a concurrent request with the same
    key inserted first; this one waited for it to commit), and on any refusal. A retry whose original committed
    between the first look and the create's own checks was refused against the original's own effects (the GPUs
    or the disk it took, the funds it committed, the refundable amount it used): it gets the original instead.
    `earlier` raises IdempotencyKeyReused (422) for the same key with another body, also then."""
    if key:
        existing = earlier()
        if existing is not None:
            return existing, False
    try:
        return create(), True
    except (IntegrityError, ApplicationError):
        existing = earlier() if key else None
        if existing is None:
            raise
        return existing, False
