"""The one place that builds Stripe clients and turns Stripe's errors into ours.

Rules for callers: never call Stripe inside a database transaction (record what you are about to do,
commit, call, then record the answer), and never rely on Stripe's Idempotency-Key for correctness
(localstripe ignores it): the project's own unique constraints decide what happens once.
"""
import stripe
from django.conf import settings

from core.errors import ApplicationError, PaymentRequired, Unavailable, UpstreamRefused

MICROS_PER_CENT = 10_000


class PaymentDeclined(PaymentRequired):
    """The card was declined (402). Named apart because a decline is told to the user (an event), other
    refusals are not."""


def client(*, connect: bool = False) -> stripe.StripeClient:
    """A Stripe client per settings: STRIPE_API_BASE (localstripe in tests and the demo), or Stripe itself.

    `connect`: for Connect transfers, which may have their own base address (STRIPE_CONNECT_API_BASE).
    """
    base = (settings.STRIPE_CONNECT_API_BASE or settings.STRIPE_API_BASE) if connect else settings.STRIPE_API_BASE
    return stripe.StripeClient(
        settings.STRIPE_SECRET_KEY,
        max_network_retries=settings.STRIPE_MAX_NETWORK_RETRIES,
        http_client=stripe.RequestsClient(timeout=settings.STRIPE_TIMEOUT_S),
        base_addresses={"api": base.rstrip("/")} if base else None,
    )


def translate(exc: stripe.StripeError, doing: str) -> ApplicationError:
    """Our error for a Stripe error raised while `doing` something (e.g. "charging your card"): PaymentDeclined
    (402), Unavailable (503: no answer or Stripe failed, so the outcome is unknown; try again later) or
    UpstreamRefused (502: Stripe answered, but refused for a reason that is not the user's card)."""
    if isinstance(exc, stripe.CardError):
        reason = (exc.user_message or "Your card was declined").rstrip(".")
        return PaymentDeclined(f"{reason}. Nothing was charged or credited; try another card.")
    # No answer, or a 5xx: Stripe may have done it (is_definite), so the message does not say it did nothing.
    if isinstance(exc, stripe.APIConnectionError):
        return Unavailable(
            f"The payment provider did not answer while {doing}, so whether it was done is not known yet. "
            "Try again in a minute."
        )
    if _idempotency_conflict(exc):
        return Unavailable(f"The payment provider is still handling an earlier attempt at {doing}; "
                           "try again in a minute.")
    if isinstance(exc, stripe.APIError | stripe.RateLimitError) or (exc.http_status or 0) >= 500:
        return Unavailable(
            f"The payment provider failed while {doing}, so whether it was done is not known yet. "
            "Try again in a minute."
        )
    message = exc.user_message or str(exc) or type(exc).__name__
    return UpstreamRefused(f"The payment provider refused {doing}: {message}")


def is_definite(exc: stripe.StripeError) -> bool:
    """True when Stripe refused for good and surely did nothing (a 4xx: a card declined, a bad destination, a key
    without the permission), so the caller fails what it asked for; False when it is to be settled or tried again
    later: no answer, a 5xx, a 409 idempotency conflict (another request with the same key is under way or was made,
    and may have done it), a rate limit (a 429, or the older 400 `rate_limit`: stripe-python's RateLimitError; Stripe
    did nothing yet and would do it a little later) or an APIError (an answer stripe-python could not place). The
    same line as `translate`'s Unavailable. (Found by review: a 429 counted as a refusal, so a rate-limited transfer
    failed its payout and told the provider to check their Stripe account.)"""
    if isinstance(exc, stripe.APIConnectionError | stripe.RateLimitError | stripe.APIError):
        return False
    if _idempotency_conflict(exc) or exc.http_status == 429:
        return False
    return 400 <= (exc.http_status or 0) < 500


def _idempotency_conflict(exc: stripe.StripeError) -> bool:
    """A request with the same Idempotency-Key is under way (a 409, which stripe-python raises as APIError) or was
    made with other parameters (IdempotencyError): either way an earlier request may have done it."""
    return isinstance(exc, stripe.IdempotencyError) or exc.http_status == 409


def cents(micros: int) -> int:
    """Micro-dollars in whole cents (Stripe's unit for USD); callers make sure there is no remainder."""
    return micros // MICROS_PER_CENT
