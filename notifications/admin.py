"""Operators may read notifications, endpoints (never their secrets) and delivery logs; nothing is edited here."""
from django.contrib import admin

from core.admin_paginator import EstimatedCountPaginator
from core.admin_search import KeySearchAdmin
from notifications.models import Notification, WebhookAttempt, WebhookDelivery, WebhookEndpoint


class ReadOnly(KeySearchAdmin):  # an id searched by its index (core/admin_search.py)
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    # Nor deleted: a notification or delivery is the record of what a user was told, and an endpoint is its
    # owner's to delete (notifications.services.webhooks.endpoint_delete locks its deliveries first, and tells them).
    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Notification)
class NotificationAdmin(ReadOnly):
    list_display = ["id", "created_at", "user", "kind", "title", "in_app", "email_status", "emailed_at", "read_at"]
    list_filter = ["kind", "in_app", "email_status"]
    search_fields = ["user__email", "dedupe_key", "title"]
    list_select_related = ["user"]
    # Millions of rows, as the deliveries below: newest first by the primary key's index (the model's
    # -created_at, -id has none, and sorted the whole table for each page), no COUNT(*) of every row (an estimate
    # when unfiltered) and no second "N total" count (core/admin_paginator.py). Found by review: 1.7 s a page at
    # a million notifications, 1.1 s at a million deliveries, growing with the table.
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    readonly_fields = ["user", "kind", "title", "body", "payload", "dedupe_key", "in_app", "email_status",
                       "email_attempts", "email_error", "email_next_at", "email_claimed_at", "emailed_at", "read_at",
                       "created_at"]


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(ReadOnly):
    list_display = ["id", "user", "url", "active", "disabled_at", "created_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["active"]
    search_fields = ["user__email", "url"]
    list_select_related = ["user"]
    # Paused by the platform after failing for days: when and why, and since when it fails (shown, not set here).
    fields = ["user", "url", "description", "secret_hint", "active", "disabled_at", "disabled_reason",
              "failing_since", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here


class AttemptInline(admin.TabularInline):
    model = WebhookAttempt
    fields = ["number", "status_code", "error", "duration_ms", "at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnly):
    list_display = ["id", "created_at", "endpoint", "kind", "status", "attempts", "last_status_code"]
    list_filter = ["status", "kind"]
    search_fields = ["endpoint__user__email", "endpoint__url", "=event_id"]
    key_terms_search_keys_only = True  # a whole UUID is an event id, found by its unique index
    list_select_related = ["endpoint"]
    ordering = ["-id"]  # as the notifications' list: the primary key's index, an estimated count, no second count
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    fields = ["endpoint", "notification", "event_id", "kind", "status", "attempts", "last_status_code", "last_error",
              "body", "created_at", "next_attempt_at", "claimed_at", "finished_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here
    inlines = [AttemptInline]
