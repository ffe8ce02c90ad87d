"""The notifications API: your notifications (list, mark read), your channels per event kind, your webhook
endpoints (CRUD, a test event) and their delivery logs. Another user's object is a 404."""
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api.filtering import reject_unknown_params
from core.api.idempotency import idempotency_key, idempotency_parameter
from core.api.schema import error_response
from core.api.scopes import ANY, SAFE_METHODS
from core.api.throttling import ScopedRateThrottle
from marketplace.models import ApiKey
from marketplace.reauth import refuse_session_alone
from notifications import selectors
from notifications.models import PREFERENCE_KINDS, Notification, WebhookDelivery, WebhookEndpoint, roles_held
from notifications.services import notify as notify_svc
from notifications.services import webhooks as webhook_svc

from .serializers import (
    NotificationSerializer,
    PreferenceInputSerializer,
    PreferenceSerializer,
    TestQueuedSerializer,
    UnreadCountSerializer,
    WebhookDeliverySerializer,
    WebhookEndpointCreatedSerializer,
    WebhookEndpointInputSerializer,
    WebhookEndpointSerializer,
)

_BOOL = {"true": True, "1": True, "false": False, "0": False}


def _key_scopes(request: Request) -> list[str] | None:
    """The scopes of the API key that authenticated the request: the notices, deliveries and endpoints of the
    roles it may read only (notifications.models.KIND_ROLES; review r55). None for a browser session: not scoped."""
    return list(request.auth.scopes) if isinstance(request.auth, ApiKey) else None


ROLE_SPLIT = ("A key without the `renter` scope (nor `read`) {what} no renter's kinds (the balance, credits to "
              "it, instances, volumes), and one without `provider` (nor `read`) no provider's (nodes, payouts, "
              "credits to the earnings); the account's kinds go to every key.")


def _unread_param(request: Request) -> bool | None:
    raw = request.query_params.get("unread")
    if raw is None or raw == "":
        return None
    if raw.lower() not in _BOOL:
        raise serializers.ValidationError({"unread": ["Must be true or false."]})
    return _BOOL[raw.lower()]


@extend_schema_view(
    list=extend_schema(summary="Your notifications, newest first", description=ROLE_SPLIT.format(what="lists"),
                       parameters=[OpenApiParameter("unread", bool,
                                                    description="Only unread (true) or only read (false) ones.")]),
    retrieve=extend_schema(summary="One of your notifications"),
)
@extend_schema(tags=["notifications"])
class NotificationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    api_scope = ANY  # core/api/scopes.py: any key; its rows those of the key's roles (models.KIND_ROLES)
    serializer_class = NotificationSerializer
    queryset = Notification.objects.none()
    known_query_params = ("unread",)  # read by get_queryset; any other is a 400 (core.api.filtering)

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        unread = _unread_param(self.request) if self.action == "list" else None
        return selectors.notifications_for(user=self.request.user, unread=unread, scopes=_key_scopes(self.request))

    @extend_schema(summary="Mark one notification read", request=None, responses={200: NotificationSerializer})
    @action(detail=True, methods=["post"])
    def read(self, request, pk=None):
        notification = notify_svc.notification_mark_read(notification=self.get_object())
        return Response(NotificationSerializer(notification).data)

    @extend_schema(summary="Mark all your notifications read", request=None,
                   description="With an API key, those it lists (the kinds of its scopes' roles) only.",
                   responses={200: UnreadCountSerializer})
    @action(detail=False, methods=["post"], url_path="read-all")
    def read_all(self, request):
        notify_svc.notifications_mark_all_read(user=request.user, scopes=_key_scopes(request))
        return Response({"unread": 0})

    @extend_schema(summary="How many of your notifications are unread",
                   description="With an API key, of those it lists (the kinds of its scopes' roles) only.",
                   responses={200: UnreadCountSerializer})
    @action(detail=False, methods=["get"], url_path="unread-count", pagination_class=None)
    def unread_count(self, request):
        return Response({"unread": selectors.unread_count(user=request.user, scopes=_key_scopes(request))})


@extend_schema(tags=["notifications"])
class PreferenceListView(APIView):
    api_scope = ANY  # core/api/scopes.py: renters and providers alike
    @extend_schema(summary="Your channels per event kind (every channel is on until you choose)",
                   responses={200: PreferenceSerializer(many=True)})
    def get(self, request):
        reject_unknown_params(request, (), paginated=False)  # a plain APIView: no filter backend runs
        return Response(PreferenceSerializer(selectors.preferences_for(user=request.user), many=True).data)


@extend_schema(tags=["notifications"])
class PreferenceDetailView(APIView):
    api_scope = ANY  # core/api/scopes.py: renters and providers alike
    @extend_schema(summary="Choose the channels of one event kind",
                   parameters=[OpenApiParameter("kind", str, OpenApiParameter.PATH,
                                                enum=[k.value for k in PREFERENCE_KINDS])],
                   request=PreferenceInputSerializer,
                   responses={200: PreferenceSerializer, 404: error_response("No such event kind.")})
    def put(self, request, kind: str):
        if kind not in PREFERENCE_KINDS:
            return Response({"detail": "No such event kind."}, status=status.HTTP_404_NOT_FOUND)
        data = PreferenceInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        notify_svc.preference_set(user=request.user, kind=kind, **data.validated_data)
        row = next(p for p in selectors.preferences_for(user=request.user) if p.kind == kind)
        return Response(PreferenceSerializer(row).data)


SETTINGS_PAGE = "on the notification settings page (it asks for your password)"
ENDPOINT_WRITES_THROTTLED = ("More than WEBHOOK_ENDPOINT_THROTTLE_RATE (10 a minute) endpoints added or changed by "
                             "you, with the API and the settings page together; nothing was changed. Retry-After "
                             "says when to try again.")
OTHER_ROLE_REFUSED = ("This webhook endpoint receives the events of a role this API key's scopes ({held}) do not "
                      "act as ({roles}): it was added on the settings page or by a key with more scopes. Change it "
                      "with such a key, or on the notification settings page; nothing was changed.")
CSRF_OR_OTHER_ROLE = ("Not allowed (for a browser session: a missing CSRF token). Or: "
                      + OTHER_ROLE_REFUSED.format(held="...", roles="..."))
SESSION_REFUSED = ("{what} asked with a browser session, not an API key: the notification settings page asks for "
                   "the password; nothing was changed.")


@extend_schema_view(
    list=extend_schema(summary="Your webhook endpoints", description=(
        "An endpoint added with an API key receives the kinds of that key's `renter` and `provider` scopes and the "
        "account's (`scopes`: the key's); one added on the settings page, every kind. A key lists the endpoints "
        "whose events it may read: a renter-only key not one that receives the provider's events.")),
    retrieve=extend_schema(summary="One of your webhook endpoints"),
    create=extend_schema(
        summary="Add a webhook endpoint (its signing secret is in this answer only)",
        request=WebhookEndpointInputSerializer,
        parameters=[idempotency_parameter(
            "Makes retries safe: the same key and body within REQUEST_REPLAY_S (10 minutes) return the same "
            "endpoint with its secret again (200), adding none; later, or with another body, the same key is a "
            "422. 1-100 printable ASCII characters.")],
        responses={
            201: WebhookEndpointCreatedSerializer,
            200: OpenApiResponse(WebhookEndpointCreatedSerializer,
                                 "The endpoint an earlier request with this Idempotency-Key added, and its secret."),
            403: error_response(SESSION_REFUSED.format(what="An endpoint")),
            429: error_response(ENDPOINT_WRITES_THROTTLED),
            422: error_response("The Idempotency-Key was used for a different request, or added its endpoint "
                                "more than 10 minutes ago (its secret is not shown again).")},
        description="It receives the event kinds of this key's `renter` and `provider` scopes and the account's "
                    "(kept as its `scopes`): a renter-only key's endpoint is sent no node, payout or earnings event."),
    partial_update=extend_schema(summary="Change an endpoint's URL, description or active flag",
                                 request=WebhookEndpointInputSerializer, responses={
                                     200: WebhookEndpointSerializer,
                                     403: error_response(SESSION_REFUSED.format(what="A new URL") + " Or: "
                                                         + OTHER_ROLE_REFUSED.format(held="...", roles="...")),
                                     429: error_response(ENDPOINT_WRITES_THROTTLED)}),
    destroy=extend_schema(summary="Delete a webhook endpoint and its delivery log", responses={
        204: None, 403: error_response(CSRF_OR_OTHER_ROLE)}),
)
@extend_schema(tags=["notifications"])
class WebhookEndpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                             viewsets.GenericViewSet):
    api_scope = ANY  # core/api/scopes.py: any key; its rows those of the key's roles (models.KIND_ROLES)
    serializer_class = WebhookEndpointSerializer
    queryset = WebhookEndpoint.objects.none()
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = webhook_svc.ENDPOINT_WRITES_SCOPE

    def get_throttles(self):
        # Adding and changing only (they may resolve the URL's host name): reading, deleting and the test button
        # (its own hourly limit) are not counted.
        return super().get_throttles() if self.action in ("create", "partial_update") else []

    def throttled(self, request, wait):
        raise exceptions.Throttled(wait, detail=webhook_svc.endpoint_writes_refused(wait or 1))

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.endpoints_for(user=self.request.user, scopes=_key_scopes(self.request))

    def get_object(self):
        endpoint = super().get_object()
        scopes = _key_scopes(self.request)
        if self.request.method not in SAFE_METHODS and not endpoint.roles <= roles_held(scopes):
            # A key with `read` lists it; a change (its URL: where the other role's events go) needs that role.
            raise exceptions.PermissionDenied(OTHER_ROLE_REFUSED.format(
                held=", ".join(sorted(scopes or ())), roles=", ".join(sorted(endpoint.roles - roles_held(scopes)))))
        return endpoint

    def create(self, request):
        # An endpoint receives the account's events until it is deleted: not for a session alone (a copied cookie).
        refuse_session_alone(request, instead=SETTINGS_PAGE)
        key, fingerprint = idempotency_key(request)
        if key:  # a retry gets the answer it lost, even if its URL would not pass the check now (its DNS)
            earlier = webhook_svc.endpoint_for_idempotency_key(user=request.user, idempotency_key=key,
                                                               request_fingerprint=fingerprint,
                                                               scopes=_key_scopes(request))
            if earlier is not None:
                return self._created(*earlier, code=status.HTTP_200_OK)
        data = WebhookEndpointInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        endpoint, secret, created = webhook_svc.endpoint_create_once(
            user=request.user, url=values["url"], description=values.get("description", ""),
            active=values.get("active", True), base_url=request.build_absolute_uri("/"),
            idempotency_key=key, request_fingerprint=fingerprint, scopes=_key_scopes(request))
        return self._created(endpoint, secret, code=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @staticmethod
    def _created(endpoint: WebhookEndpoint, secret: str, *, code: int) -> Response:
        body = {**WebhookEndpointSerializer(endpoint).data, "secret": secret}  # as WebhookEndpointCreatedSerializer
        response = Response(body, status=code)
        response["Cache-Control"] = "no-store"
        return response

    def partial_update(self, request, pk=None):
        endpoint = self.get_object()
        data = WebhookEndpointInputSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        if "url" in data.validated_data and data.validated_data["url"] != endpoint.url:  # where the events go
            refuse_session_alone(request, instead=SETTINGS_PAGE)
        endpoint = webhook_svc.endpoint_update(endpoint=endpoint, **data.validated_data,
                                               base_url=request.build_absolute_uri("/"))
        return Response(WebhookEndpointSerializer(endpoint).data)

    def perform_destroy(self, instance):
        webhook_svc.endpoint_delete(endpoint=instance)

    @extend_schema(summary="Send a test event to this endpoint (queued; read its delivery for the outcome)",
                   request=None, responses={202: TestQueuedSerializer, 429: error_response(
                       "More than NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR (10) test events this hour."),
                       403: error_response(CSRF_OR_OTHER_ROLE)})
    @action(detail=True, methods=["post"])
    def test(self, request, pk=None):
        delivery = webhook_svc.endpoint_test(endpoint=self.get_object())
        return Response({"endpoint": delivery.endpoint_id, "delivery": delivery.pk, "event_id": str(delivery.event_id),
                         "status": delivery.status}, status=status.HTTP_202_ACCEPTED)


@extend_schema_view(
    list=extend_schema(summary="Your webhook deliveries, newest first (every attempt with its answer)",
                       description="A delivery finished (delivered or given up) more than "
                                   "NOTIFICATIONS_WEBHOOK_LOG_DAYS (30) days ago is deleted with its attempts. "
                                   + ROLE_SPLIT.format(what="lists"),
                       parameters=[OpenApiParameter("endpoint", {"type": "integer", "minimum": 1},
                                                    description="Only this endpoint's (its id).")]),
    retrieve=extend_schema(summary="One of your webhook deliveries"),
)
@extend_schema(tags=["notifications"])
class WebhookDeliveryViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    api_scope = ANY  # core/api/scopes.py: any key; its rows those of the key's roles (models.KIND_ROLES)
    serializer_class = WebhookDeliverySerializer
    queryset = WebhookDelivery.objects.none()
    known_query_params = ("endpoint",)  # read by get_queryset; any other is a 400 (core.api.filtering)

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        endpoint_id = None
        raw = self.request.query_params.get("endpoint") if self.action == "list" else None
        if raw:
            if not (raw.isascii() and raw.isdigit()):  # str.isdigit alone takes "²", which int() refuses
                raise serializers.ValidationError({"endpoint": ["Must be an endpoint's id."]})
            endpoint_id = get_object_or_404(selectors.endpoints_for(user=self.request.user), pk=int(raw)).pk
        return (selectors.deliveries_for(user=self.request.user, endpoint_id=endpoint_id,
                                         scopes=_key_scopes(self.request))
                .prefetch_related("attempt_log"))
