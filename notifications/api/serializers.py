"""Serializers of the notifications API (input ones strict: unknown fields are a 400 naming them)."""
from typing import Any

from rest_framework import serializers

from core.api.fields import StrictFieldsMixin
from core.api.scopes import ALL_SCOPES
from core.validators import no_control_characters
from notifications.models import PREFERENCE_KINDS, Notification, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from notifications.services.urls import URL_MAX_LENGTH
from notifications.services.webhooks import DESCRIPTION_MAX_LENGTH


class NotificationSerializer(serializers.ModelSerializer[Notification]):
    read = serializers.SerializerMethodField()

    class Meta:
        model = Notification
        fields = ["id", "kind", "title", "body", "payload", "created_at", "read", "read_at"]

    def get_read(self, notification: Notification) -> bool:
        return notification.read_at is not None


class UnreadCountSerializer(serializers.Serializer[Any]):
    unread = serializers.IntegerField()


class PreferenceSerializer(serializers.Serializer[Any]):
    kind = serializers.ChoiceField(choices=[(k.value, k.label) for k in PREFERENCE_KINDS], read_only=True)
    description = serializers.CharField(source="label", read_only=True)
    in_app = serializers.BooleanField()
    email = serializers.BooleanField()
    webhook = serializers.BooleanField()


class PreferenceInputSerializer(StrictFieldsMixin, serializers.Serializer[Any]):
    in_app = serializers.BooleanField(help_text="Show it in your notifications list.")
    email = serializers.BooleanField(help_text="E-mail it to your account's address.")
    webhook = serializers.BooleanField(help_text="POST it to your active webhook endpoints.")


class WebhookEndpointSerializer(serializers.ModelSerializer[WebhookEndpoint]):
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=ALL_SCOPES), read_only=True, help_text=(
        "The scopes of the API key that added it (every scope: added on the settings page): it receives the event "
        "kinds of their `renter` and `provider` roles, and the account's."))

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "url", "description", "active", "secret_hint", "created_at", "disabled_at", "disabled_reason",
                  "scopes"]


class WebhookEndpointCreatedSerializer(WebhookEndpointSerializer):
    secret = serializers.CharField(help_text="The signing secret: shown this once, never again. Verify each "
                                             "event's X-GPUMarket-Signature with it.")

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]


class WebhookEndpointInputSerializer(StrictFieldsMixin, serializers.Serializer[Any]):
    read_only_elsewhere = ("id", "secret_hint", "created_at", "secret", "scopes")
    url = serializers.CharField(max_length=URL_MAX_LENGTH, validators=[no_control_characters],
                                help_text="https:// to a public address; it receives signed JSON POSTs.")
    description = serializers.CharField(max_length=DESCRIPTION_MAX_LENGTH, required=False, allow_blank=True,
                                        validators=[no_control_characters])
    active = serializers.BooleanField(required=False, help_text="A paused endpoint receives only test events.")


class WebhookAttemptSerializer(serializers.ModelSerializer[WebhookAttempt]):
    class Meta:
        model = WebhookAttempt
        fields = ["number", "status_code", "error", "duration_ms", "at"]


class WebhookDeliverySerializer(serializers.ModelSerializer[WebhookDelivery]):
    endpoint = serializers.IntegerField(source="endpoint_id")
    attempt_log = WebhookAttemptSerializer(many=True, help_text="Every attempt, oldest first.")

    class Meta:
        model = WebhookDelivery
        fields = ["id", "endpoint", "event_id", "kind", "status", "attempts", "last_status_code", "last_error",
                  "created_at", "next_attempt_at", "finished_at", "body", "attempt_log"]


class TestQueuedSerializer(serializers.Serializer[Any]):
    endpoint = serializers.IntegerField()
    delivery = serializers.IntegerField(help_text="Read it at /api/v1/webhook-deliveries/{delivery}/.")
    event_id = serializers.UUIDField()
    status = serializers.CharField()
