"""A user's billing settings: the Stripe Connect account payouts go to, and automatic top-ups.

The rules of a profile live here, whoever changes it (the API's PATCH, the payouts page): the views parse and call.
"""
import re
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.models import BillingProfile, Card
from billing.services.customers import profile_for
from billing.services.payouts import payouts_pending_elsewhere, payouts_pending_elsewhere_text
from billing.services.top_ups import top_up_bounds
from core.errors import ValidationFailed
from core.security_mail import security_change_notify
from marketplace.models import User
from marketplace.money import usd_text

# A Stripe Connect account id, or "" for none; the payouts form uses it.
CONNECT_ACCOUNT_ID = r"^(acct_[A-Za-z0-9]{1,90})?$"
# The same without "": for a field that allows blank by itself. The schema publishes such a field as oneOf(this
# pattern, maxLength 0), and a pattern that also matched "" made "" match both, which oneOf forbids.
CONNECT_ACCOUNT_ID_SET = r"^acct_[A-Za-z0-9]{1,90}$"
_CONNECT_ACCOUNT_RE = re.compile(CONNECT_ACCOUNT_ID)
CONNECT_ACCOUNT_MESSAGE = "A Stripe Connect account id looks like acct_1A2b3C4d."


class _Keep:
    """The card is left as it is (None would remove it)."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()


@dataclass(frozen=True, kw_only=True)
class ProfileChanges:
    """What to change; None (for the card: KEEP) leaves a setting as it is."""

    stripe_connect_account_id: str | None = None
    auto_top_up_enabled: bool | None = None
    auto_top_up_threshold_micros: int | None = None
    auto_top_up_amount_micros: int | None = None
    auto_top_up_card_id: int | None | _Keep = KEEP

    def touches_auto_top_up(self) -> bool:
        return not isinstance(self.auto_top_up_card_id, _Keep) or any(
            value is not None for value in (self.auto_top_up_enabled, self.auto_top_up_threshold_micros,
                                            self.auto_top_up_amount_micros))


@transaction.atomic
def profile_update(*, user: User, changes: ProfileChanges, base_url: str = "") -> BillingProfile:
    """Apply the changes; refused (ValidationFailed naming the field, nothing written) when the result breaks a rule.

    Auto top-up, when on (switched on now or before) and changed now, needs a saved card of the user's, an amount
    within the top-up bounds and a threshold above zero. A new payout account is e-mailed to the account's address
    (whoever changed it, the owner learns where the earnings go now); `base_url` makes the e-mail's reset link.
    """
    profile = profile_for(user=user)
    profile = BillingProfile.objects.select_for_update().get(pk=profile.pk)
    auto_top_up_before = _auto_top_up_settings(profile)
    if changes.stripe_connect_account_id is not None:
        if not _CONNECT_ACCOUNT_RE.fullmatch(changes.stripe_connect_account_id):
            raise ValidationFailed(CONNECT_ACCOUNT_MESSAGE, field="stripe_connect_account_id")
        before, after = profile.stripe_connect_account_id, changes.stripe_connect_account_id
        if after != before:
            # A payout still pending keeps its account (payouts_pending_elsewhere): said, not "earnings stay here".
            pending = payouts_pending_elsewhere_text(payouts_pending_elsewhere(user_id=user.pk, account=after))
            kept = " (earnings not in a payout being sent stay on the platform until one is set)" if pending else (
                " (earnings stay on the platform until one is set)")
            security_change_notify(
                user=user, subject="Your payout account was changed", base_url=base_url,
                change=(f"The Stripe Connect account your {settings.PLATFORM_NAME} earnings are paid out to was "
                        f"just changed: from {before or 'none'} to {after or 'none'}{'' if after else kept}."
                        f"{' ' + pending if pending else ''}"))
        profile.stripe_connect_account_id = after
    if not isinstance(changes.auto_top_up_card_id, _Keep):
        card = None
        if changes.auto_top_up_card_id is not None:
            card = Card.objects.filter(pk=changes.auto_top_up_card_id, user=user).first()
            if card is None:
                raise ValidationFailed("No such card of yours.", field="auto_top_up_card")
        profile.auto_top_up_card = card
    if changes.auto_top_up_threshold_micros is not None:
        profile.auto_top_up_threshold_micros = changes.auto_top_up_threshold_micros
    if changes.auto_top_up_amount_micros is not None:
        profile.auto_top_up_amount_micros = changes.auto_top_up_amount_micros
    if changes.auto_top_up_enabled is not None:
        profile.auto_top_up_enabled = changes.auto_top_up_enabled
    # Judged when this change moves a setting of it (sent back as they are, they are no change): the bounds may
    # have moved since auto top-up was set, and setting only the payout account was refused for an amount it does
    # not touch (the admin's save a 500, found by review).
    if profile.auto_top_up_enabled and _auto_top_up_settings(profile) != auto_top_up_before:
        _check_auto_top_up(profile)
    if changes.touches_auto_top_up():
        profile.auto_top_up_changed_at = timezone.now()
    profile.save()
    return profile


def _auto_top_up_settings(profile: BillingProfile) -> tuple[bool, int, int, int | None]:
    return (profile.auto_top_up_enabled, profile.auto_top_up_threshold_micros, profile.auto_top_up_amount_micros,
            profile.auto_top_up_card_id)


def _check_auto_top_up(profile: BillingProfile) -> None:
    """Every problem at once (one answer naming each field), not the first only."""
    problems: dict[str, str] = {}
    if profile.auto_top_up_card_id is None:
        problems["auto_top_up_card"] = "Auto top-up needs a saved card."
    low, high = top_up_bounds()
    if not low <= profile.auto_top_up_amount_micros <= high:
        problems["auto_top_up_amount"] = f"Between {usd_text(low)} and {usd_text(high)}."
    if profile.auto_top_up_threshold_micros <= 0:
        problems["auto_top_up_threshold"] = "Give a threshold above zero."
    ValidationFailed.check(problems)
