"""What the billing API's modules share: money fields, error answers, the check of query parameters."""
import re

from django.conf import settings
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers
from rest_framework.response import Response

from billing.services.stripe_gateway import PaymentError
from marketplace.api.fields import UsdField
from marketplace.api.filtering import reject_unknown_params  # noqa: F401 (the billing views use it from here)
from marketplace.api.schema import ErrorDetailSerializer


class MoneyField(UsdField):
    """USD with six places, like prices, but room for balances and totals up to $999,999,999,999."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_digits", 18)
        super().__init__(**kwargs)


class CentsField(serializers.DecimalField):
    """USD in whole cents as a plain decimal string ("25" or "25.00"): no exponents, no more places."""

    _PLAIN = re.compile(r"\d{1,7}(\.\d{1,2})?")

    def __init__(self, **kwargs):
        kwargs.setdefault("max_digits", 9)
        kwargs.setdefault("decimal_places", 2)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, str) and not self._PLAIN.fullmatch(data.strip()):
            self.fail("invalid")
        return super().to_internal_value(data)


def top_up_amount_field(**kwargs):
    return CentsField(min_value=settings.BILLING_TOP_UP_MIN_USD, max_value=settings.BILLING_TOP_UP_MAX_USD, **kwargs)


def error_response(code: int, text: str) -> OpenApiResponse:
    return OpenApiResponse(ErrorDetailSerializer, text)


E402 = error_response(402, "The card was declined; nothing was charged or credited. `detail` says why.")
E409 = error_response(409, "The state of the top-up or balance forbids it; `detail` says why.")
E502 = error_response(502, "The payment provider refused the request; nothing was done.")
E503 = error_response(503, "The payment provider could not be reached; nothing was done. Try again later.")


class PaymentErrorsMixin:
    """Payment errors become their HTTP answers ({"detail": ...}, or the field at fault for a 400)."""

    def handle_exception(self, exc):
        if isinstance(exc, PaymentError):
            if exc.status_code == 400 and exc.field:
                body = {exc.field: [exc.message]}
            else:
                body = {"detail": exc.message}
                if getattr(exc, "top_up", None) is not None:
                    body["top_up"] = exc.top_up
            return Response(body, status=exc.status_code)
        return super().handle_exception(exc)

