"""Saved cards: list, save (a SetupIntent, then its id or the payment method's), forget."""
from django.core.validators import RegexValidator
from django.http import Http404
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from billing import selectors
from billing.api.common import E402, E502, E503
from billing.models import Card
from billing.services.cards import (
    PAYMENT_METHOD_ID,
    SETUP_INTENT_ID,
    card_add,
    card_remove,
    setup_intent_create,
)
from core.api.fields import StrictFieldsMixin
from core.api.no_store import NoStoreMixin
from core.api.scopes import RENTER_ONLY


class CardSerializer(serializers.ModelSerializer):
    class Meta:
        model = Card
        fields = ["id", "brand", "last4", "exp_month", "exp_year", "created_at"]
        read_only_fields = fields


class CardCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    # The ids' shapes as billing.services.cards checks them, here too so that the schema says them.
    payment_method = serializers.CharField(
        max_length=100, required=False, help_text="A payment method id (pm_...) from Stripe.js.",
        validators=[RegexValidator(PAYMENT_METHOD_ID, "A payment method id looks like pm_...")])
    setup_intent = serializers.CharField(
        max_length=100, required=False, help_text="A SetupIntent (seti_...) you confirmed with the card.",
        validators=[RegexValidator(SETUP_INTENT_ID, "A SetupIntent id looks like seti_...")])
    schema_presence = {"oneOf": [{"required": ["payment_method"]}, {"required": ["setup_intent"]}]}

    def validate(self, attrs):
        if bool(attrs.get("payment_method")) == bool(attrs.get("setup_intent")):
            raise ValidationError({"payment_method": ["Give either `payment_method` or `setup_intent`."]})
        return attrs


class SetupIntentSerializer(serializers.Serializer):
    setup_intent = serializers.CharField()
    client_secret = serializers.CharField(help_text="For Stripe.js: stripe.confirmCardSetup(client_secret, ...).")
    publishable_key = serializers.CharField()


@extend_schema_view(
    list=extend_schema(summary="Your saved cards"),
    create=extend_schema(summary="Save a card", request=CardCreateSerializer, responses={
        201: CardSerializer, 200: OpenApiResponse(CardSerializer, "The card was saved before."),
        402: E402, 502: E502, 503: E503}),
    destroy=extend_schema(summary="Forget a saved card", responses={204: None}),
    setup_intent=extend_schema(summary="Start saving a card (a Stripe SetupIntent)", request=None,
                               responses={201: SetupIntentSerializer, 502: E502, 503: E503}),
)
@extend_schema(tags=["billing"])
class CardViewSet(NoStoreMixin, mixins.ListModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Cards are saved at Stripe; here only their brand, last digits and expiry are kept."""

    api_scope = RENTER_ONLY  # core/api/scopes.py
    serializer_class = CardSerializer
    queryset = Card.objects.none()
    filterset_class = None
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.cards_for_user(user=self.request.user)

    def get_object(self):
        pk = self.kwargs["pk"]
        if not (str(pk).isascii() and str(pk).isdigit()):  # "²" is a digit to Python, not to int()
            raise Http404
        return super().get_object()

    def create(self, request):
        data = CardCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        card, created = card_add(user=request.user, payment_method=data.validated_data.get(
            "payment_method", ""), setup_intent=data.validated_data.get("setup_intent", ""))
        return Response(CardSerializer(card).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def perform_destroy(self, instance):
        card_remove(card=instance)

    @action(detail=False, methods=["post"], url_path="setup-intent")
    def setup_intent(self, request):
        return Response(SetupIntentSerializer(setup_intent_create(user=request.user)).data,
                        status=status.HTTP_201_CREATED)
