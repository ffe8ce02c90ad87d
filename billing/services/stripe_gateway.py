"""The one place that builds Stripe clients and turns Stripe's errors into ours.

Rules for callers: never call Stripe inside a database transaction (record what you are about to do,
commit, call, then record the answer), and never rely on Stripe's Idempotency-Key for correctness
(localstripe ignores it): the project's own unique constraints decide what happens once.
"""
import stripe
from django.conf import settings

MICROS_PER_CENT = 10_000


class PaymentError(Exception):
    """A payment operation that did not happen; `status_code` is the HTTP answer."""

    status_code = 400

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.top_up: int | None = None  # the top-up that failed, when there is one


class PaymentInvalid(PaymentError):
    """The request is wrong (400); `field` names the input at fault."""


class PaymentDeclined(PaymentError):
    """The card was declined (402)."""

    status_code = 402


class PaymentConflict(PaymentError):
    """Valid, but the state of the top-up, refund or balance forbids it (409)."""

    status_code = 409


class PaymentIdempotencyKeyReused(PaymentError):
    status_code = 422


class PaymentProviderRefused(PaymentError):
    """Stripe answered, but refused the request for a reason that is not the user's card (502)."""

    status_code = 502


class PaymentProviderUnavailable(PaymentError):
    """Stripe could not be reached or failed (503): nothing happened; try again later."""

    status_code = 503


def client(*, connect: bool = False) -> stripe.StripeClient:
    """A Stripe client per settings: STRIPE_API_BASE (localstripe in tests and the demo), or Stripe itself.

    `connect`: for Connect transfers, which may have their own base address (STRIPE_CONNECT_API_BASE).
    """
    base = (settings.STRIPE_CONNECT_API_BASE or settings.STRIPE_API_BASE) if connect else settings.STRIPE_API_BASE
    kwargs = {"base_addresses": {"api": base.rstrip("/")}} if base else {}
    return stripe.StripeClient(
        settings.STRIPE_SECRET_KEY,
        max_network_retries=settings.STRIPE_MAX_NETWORK_RETRIES,
        http_client=stripe.RequestsClient(timeout=settings.STRIPE_TIMEOUT_S),
        **kwargs,
    )


def translate(exc: stripe.StripeError, doing: str) -> PaymentError:
    """Our error for a Stripe error raised while `doing` something (e.g. "charging your card")."""
    if isinstance(exc, stripe.CardError):
        reason = (exc.user_message or "Your card was declined").rstrip(".")
        return PaymentDeclined(f"{reason}. Nothing was charged or credited; try another card.")
    if isinstance(exc, stripe.APIConnectionError):
        return PaymentProviderUnavailable(
            f"The payment provider could not be reached while {doing}; nothing was done. Try again in a minute."
        )
    if isinstance(exc, stripe.APIError | stripe.RateLimitError) or (exc.http_status or 0) >= 500:
        return PaymentProviderUnavailable(
            f"The payment provider failed while {doing}; nothing was done. Try again in a minute."
        )
    message = exc.user_message or str(exc) or type(exc).__name__
    return PaymentProviderRefused(f"The payment provider refused {doing}: {message}")


def is_definite(exc: stripe.StripeError) -> bool:
    """True when Stripe surely did nothing (it answered with a 4xx); False when the outcome is unknown."""
    return not isinstance(exc, stripe.APIConnectionError) and 400 <= (exc.http_status or 0) < 500


def cents(micros: int) -> int:
    """Micro-dollars in whole cents (Stripe's unit for USD); callers make sure there is no remainder."""
    return micros // MICROS_PER_CENT
