"""The Stripe webhook: Stripe's events, verified with the Stripe-Signature header."""
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from billing.services.webhooks import STRIPE_EVENT_FIELD_MAX, WebhookInvalid, webhook_receive
from core.api.schema import error_response
from core.api.scopes import PUBLIC


class StripeEventDataSerializer(serializers.Serializer):
    object = serializers.DictField(help_text="The object the event is about (a PaymentIntent, ...).")


class StripeEventSerializer(serializers.Serializer):
    """A Stripe event, as Stripe sends it (more fields than these; they are kept as they are)."""

    id = serializers.CharField(min_length=1, max_length=STRIPE_EVENT_FIELD_MAX,
                               help_text="The event's id (evt_...): each is acted on once.")
    type = serializers.CharField(min_length=1, max_length=STRIPE_EVENT_FIELD_MAX,
                                 help_text="e.g. payment_intent.succeeded.")
    data = StripeEventDataSerializer()  # type: ignore[assignment]  # a declared field (DRF's metaclass takes it)


class WebhookAnswerSerializer(serializers.Serializer):
    received = serializers.BooleanField()
    status = serializers.CharField(help_text="processed, ignored (not an event this platform acts on) or failed.")


@extend_schema(tags=["billing"])
class StripeWebhookView(APIView):
    """Stripe's events. Verified with the Stripe-Signature header (the webhook secret); each event id is
    acted on once however often it is delivered."""

    api_scope = PUBLIC  # core/api/scopes.py
    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(
        summary="Stripe webhook (called by Stripe)",
        request={"application/json": StripeEventSerializer},
        parameters=[OpenApiParameter(
            "Stripe-Signature", {"type": "string", "minLength": 1}, OpenApiParameter.HEADER, required=True,
            description="t=<timestamp>,v1=<HMAC-SHA256 of \"t.body\" with the webhook secret>; the timestamp "
                        "within 300 s of now, before or after.")],
        responses={200: WebhookAnswerSerializer,
                   400: error_response("Missing or bad signature (or one made more than 300 s from now), or "
                                       "not an event (a JSON object with `id`, `type` and `data.object`): "
                                       "nothing was recorded."),
                   500: error_response(
                       "Processing failed; the event is kept as failed and Stripe delivers it again.")},
    )
    def post(self, request):
        try:
            event = webhook_receive(payload=request.body, signature=request.headers.get("Stripe-Signature"))
        except WebhookInvalid as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        code = status.HTTP_500_INTERNAL_SERVER_ERROR if event.status == "failed" else status.HTTP_200_OK
        return Response({"received": True, "status": event.status}, status=code)
