"""The one error hierarchy of the domain: services raise these, and nothing else, for a request they refuse.

Each class carries its HTTP answer (`status_code`) and a stable machine `code`; `message` is written for the
person who asked (API clients and the pages show it as it is), `field` names the input at fault when there is
one. They are mapped once for the API (core.api.errors.exception_handler) and once for the pages
(core.web_errors). A service may subclass one to attach figures (`InsufficientFunds.funds`) but never to
change how it is answered.
"""
from __future__ import annotations

from typing import Any


class ApplicationError(Exception):
    """A request the domain refuses; nothing was written."""

    status_code = 400
    code = "invalid"

    def __init__(self, message: str, *, field: str | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        # Extra members of the API's error body (e.g. {"top_up": 12}); never secrets.
        self.extra: dict[str, Any] = dict(extra or {})

    def __str__(self) -> str:
        return self.message


class ValidationFailed(ApplicationError):
    """The input breaks a rule (400); `field` names it when one field is at fault, `errors` ({field: [message]})
    every field at fault when a service checked several at once (then `message` and `field` are the first)."""

    def __init__(self, message: str, *, field: str | None = None, extra: dict[str, Any] | None = None,
                 errors: dict[str, list[str]] | None = None):
        super().__init__(message, field=field, extra=extra)
        self.errors: dict[str, list[str]] = dict(errors) if errors else ({field: [message]} if field else {})

    @classmethod
    def check(cls, problems: dict[str, str]) -> None:
        """Raise one ValidationFailed naming every field of `problems` ({field: message}), if there is any."""
        if problems:
            field, message = next(iter(problems.items()))
            raise cls(message, field=field, errors={name: [text] for name, text in problems.items()})


class PermissionDenied(ApplicationError):
    """The caller may not do this (403)."""

    status_code = 403
    code = "permission_denied"


class NotFound(ApplicationError):
    """No such object, or not one of the caller's (404: another owner's object is not acknowledged)."""

    status_code = 404
    code = "not_found"


class Conflict(ApplicationError):
    """Valid, but the current state of something forbids it (409)."""

    status_code = 409
    code = "conflict"


class PaymentRequired(ApplicationError):
    """Money stands in the way: a balance too low or a card declined (402)."""

    status_code = 402
    code = "payment_required"


class IdempotencyKeyReused(ApplicationError):
    """The Idempotency-Key was used before for a different request (422)."""

    status_code = 422
    code = "idempotency_key_reused"


class TooManyRequests(ApplicationError):
    """Valid, but asked too often for now: a limit per address or account; try again later (429)."""

    status_code = 429
    code = "too_many_requests"


class UpstreamRefused(ApplicationError):
    """A service we depend on (the payment provider) answered but refused, not for the user's reason (502)."""

    status_code = 502
    code = "upstream_refused"


class Unavailable(ApplicationError):
    """Something we depend on could not be reached; nothing was done, try again later (503)."""

    status_code = 503
    code = "unavailable"
