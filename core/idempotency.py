"""What makes a retried create safe: the Idempotency-Key a client sends and the body it sent with it.

Shared by every create that may be retried (instances, top-ups). The services store the key and the
body's fingerprint under a unique constraint; the same key with another body is refused.
"""
import hashlib
import json
import re

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e]{1,100}")  # 1-100 printable ASCII characters


def request_fingerprint(data: object) -> str:
    """SHA-256 of the body in a canonical form: key order and spacing do not change it."""
    if hasattr(data, "lists"):  # a QueryDict (form data): every value is a list
        data = dict(data.lists())
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
