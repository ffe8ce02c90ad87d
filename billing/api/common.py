"""What the billing API's modules share: the top-up amount field and the descriptions of the payment errors' answers.

The answers themselves come from the one handler (core.api.errors): services raise core.errors classes."""
from django.conf import settings

from core.api.fields import CentsField
from core.api.schema import error_response


def top_up_amount_field(**kwargs) -> CentsField:
    """An amount in whole cents within billing's top-up bounds (BILLING_TOP_UP_MIN_USD/MAX_USD)."""
    return CentsField(min_value=settings.BILLING_TOP_UP_MIN_USD, max_value=settings.BILLING_TOP_UP_MAX_USD, **kwargs)


# The published description of the top-up and refund operations that have none of their own.
PAYMENT_ERRORS = 'Payment errors become their HTTP answers ({"detail": ...}, or the field at fault for a 400).'
E402 = error_response("The card was declined; nothing was charged or credited. `detail` says why.")
E409 = error_response("The state of the top-up or balance forbids it; `detail` says why.")
E502 = error_response("The payment provider refused the request; nothing was done.")
E503 = error_response("The payment provider did not answer or failed, so whether it acted is not known yet; "
                      "`detail` says what happens next. Try again later.")
