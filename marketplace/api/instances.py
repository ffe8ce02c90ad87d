"""Instances: book GPUs of an offer (a catalogue image or one's own, with env, onstart, ports), follow the
instance, read its logs, stop / start / restart / destroy it.

Thin: the serializers (instance_serializers.py) check the input, marketplace.services.instances holds every rule
(allocation, idempotency, the state machine), and errors come back through api.errors.
"""

from typing import Any

import django_filters
from django.utils.crypto import salted_hmac
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from core.api.filtering import reject_unknown_params
from core.api.idempotency import idempotency_key as idempotency_key_of
from core.api.idempotency import idempotency_parameter
from core.api.schema import CodedErrorSerializer, ErrorDetailSerializer
from core.api.scopes import RENTER_ONLY
from core.idempotency import request_fingerprint
from core.money import usd_to_micros
from marketplace.models import Instance, InstanceStatus
from marketplace.selectors import instances_with_given_back
from marketplace.services import instances as svc
from marketplace.services.instances import options as opts
from provisioning.services.vms import vm_logs

from .instance_serializers import InstanceCreateSerializer, InstanceLogsSerializer, InstanceSerializer


def _fingerprint(request) -> str:
    """The body's fingerprint for the Idempotency-Key, with a registry login, the env and an onstart script replaced
    by keyed hashes of them, so that no plain hash of a password, an env value or a script (renters put tokens in
    it: found by review) is stored (a retry with the same ones still matches). An empty script stays as sent: the
    fingerprints of creates without one are those stored before; a create with one made before this and retried
    with its key is a 422 naming the instance it made, never a second booking."""
    data = request.data
    for name in ("registry_auth", "env", "onstart"):
        if isinstance(data, dict) and name in data and (name != "onstart" or data[name]):
            data = {**data, name: salted_hmac(f"instance-{name.replace('_', '-')}",
                                              request_fingerprint(data[name])).hexdigest()}
    return request_fingerprint(data)


class InstanceFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=InstanceStatus.choices,
                                                 help_text="Repeat the parameter for several.")

    class Meta:
        model = Instance
        fields: list[str] = []


_CONFLICT = OpenApiResponse(ErrorDetailSerializer, "The instance's (or its node's) state forbids this; "
                                                   "`detail` says why.")
_VERB: dict[str, Any] = {"request": None, "responses": {202: InstanceSerializer, 409: _CONFLICT}}


@extend_schema_view(
    list=extend_schema(summary="Your instances"),
    retrieve=extend_schema(summary="One of your instances"),
    create=extend_schema(
        summary="Rent GPUs: create an instance",
        request=InstanceCreateSerializer,
        parameters=[idempotency_parameter(
            "Makes retries safe: the same key and body return the same instance (200); "
            "the same key with another body is a 422. 1-100 printable ASCII characters.",
        )],
        responses={
            201: InstanceSerializer,
            200: OpenApiResponse(InstanceSerializer, "The instance an earlier request with this Idempotency-Key "
                                                     "created."),
            402: OpenApiResponse(ErrorDetailSerializer, "Your balance is less than one hour of what your running "
                                                        "and starting instances and your storage cost with this "
                                                        "one; `detail` gives the burn rate counted and how much to "
                                                        "top up."),
            403: OpenApiResponse(CodedErrorSerializer, "`code` `email_not_verified`: your e-mail address is not "
                                                       "verified yet (POST /api/v1/auth/verify-email/ sends the "
                                                       "link again); or the "
                                                       "API key lacks the `renter` scope (a browser session: a "
                                                       "missing CSRF token)."),
            409: OpenApiResponse(CodedErrorSerializer, "Not enough free GPUs on the node, the offer is not "
                                                       "available now (the reason named), its server has less "
                                                       "free disk left than `disk_gb` (the room left named), or "
                                                       "`code` `price_changed`: the offer's price is now above "
                                                       "`max_price_per_gpu_hour` (the body's `price_per_gpu_hour` "
                                                       "and `max_price_per_gpu_hour` give both; nothing booked), "
                                                       "or its disk price above `max_disk_price_per_gb_month` "
                                                       "(`disk_price_per_gb_month` and "
                                                       "`max_disk_price_per_gb_month` give both)."),
            422: OpenApiResponse(ErrorDetailSerializer, "The Idempotency-Key was used for a different request."),
        },
    ),
    destroy=extend_schema(summary="Destroy an instance (its disk too)", responses={
        202: OpenApiResponse(InstanceSerializer, "Destroying; again while destroying is a no-op."),
        409: OpenApiResponse(ErrorDetailSerializer, "Already destroyed."),
    }),
    stop=extend_schema(summary="Stop a running instance (keeps the disk, frees the GPUs)",
                       description="Billing for GPU time ends when you ask to stop. While stopped, its disk is "
                                   "billed per second at `disk_price_per_gb_month` (the node's published disk "
                                   "price at booking).", **_VERB),
    start=extend_schema(summary="Start a stopped instance (on the same GPUs when free)",
                        description="Needs one hour of what your running and starting instances and your "
                                    "storage cost with this one in your balance (else 402). Billing resumes once "
                                    "it is running.",
                        request=None, responses={202: InstanceSerializer,
                                                 409: OpenApiResponse(ErrorDetailSerializer, "It is not stopped, "
                                                                      "or its node cannot run it now (retired, "
                                                                      "offline, in maintenance, its GPUs taken, "
                                                                      "or its provider's account deactivated: it "
                                                                      "stays stopped, its disk kept); `detail` "
                                                                      "says why."),
                                                 402: OpenApiResponse(ErrorDetailSerializer, "Your balance is less "
                                                                      "than one hour of what your running and "
                                                                      "starting instances and your storage cost "
                                                                      "with this one."),
                                                 403: OpenApiResponse(CodedErrorSerializer, "`code` "
                                                                      "`email_not_verified`: your e-mail address "
                                                                      "is not verified (again) yet; or the API "
                                                                      "key lacks the `renter` scope (a browser "
                                                                      "session: a missing CSRF token).")}),
    restart=extend_schema(summary="Restart (reboot) a running instance", **_VERB),
    logs=extend_schema(
        summary="The last lines of an instance's log (image pull, boot, onstart)",
        description="Read from its node while you wait (a few seconds at most).",
        parameters=[OpenApiParameter("tail", {"type": "integer", "minimum": 1, "maximum": opts.LOGS_TAIL_MAX},
                                     OpenApiParameter.QUERY,
                                     description=f"How many of the last lines: 1 to {opts.LOGS_TAIL_MAX} "
                                                 f"(default {opts.LOGS_TAIL_DEFAULT}).")],
        responses={200: InstanceLogsSerializer,
                   409: OpenApiResponse(ErrorDetailSerializer, "The instance has no VM now (not created yet, or "
                                                               "destroyed)."),
                   503: OpenApiResponse(ErrorDetailSerializer, "Its node did not answer in time; try again.")}),
)
@extend_schema(tags=["instances"])
class InstanceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Your instances; another user's instance is a 404. Verbs answer 202 while a worker acts."""

    api_scope = RENTER_ONLY  # core/api/scopes.py
    serializer_class = InstanceSerializer
    filterset_class = InstanceFilter
    queryset = Instance.objects.none()  # for the schema; get_queryset scopes to the user

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        # cost_so_far and disk_cost_so_far are net of what was given back of their charges: carried in the list's
        # own query.
        return instances_with_given_back(svc.instances_for_user(user=self.request.user))

    def _render(self, instance, code=status.HTTP_200_OK):
        fresh = self.get_queryset().get(pk=instance.pk)
        return Response(InstanceSerializer(fresh).data, status=code)

    def create(self, request):
        idempotency_key, _ = idempotency_key_of(request)
        fingerprint = _fingerprint(request) if idempotency_key else ""
        if idempotency_key:  # a retry gets what the first request made, even if its input would not validate now
            earlier = svc.instance_for_idempotency_key(renter=request.user, idempotency_key=idempotency_key,
                                                       request_fingerprint=fingerprint)
            if earlier is not None:
                return self._render(earlier)
        data = InstanceCreateSerializer(data=request.data, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        v = data.validated_data
        public_keys = [k.public_key for k in v.get("ssh_keys", [])]
        if v.get("ssh_public_key"):
            public_keys.append(v["ssh_public_key"])
        instance, created = svc.instance_create(
            renter=request.user, node_id=v["offer"], num_gpus=v["num_gpus"], image=v["image"],
            mig_profile=v["mig_profile"], require_nvlink=v["require_nvlink"],
            ssh_public_keys=public_keys, disk_gb=v.get("disk_gb"), label=v["label"], options=data.options(),
            idempotency_key=idempotency_key, request_fingerprint=fingerprint, volumes=v.get("volumes"),
            max_price_micros=(usd_to_micros(v["max_price_per_gpu_hour"]) if "max_price_per_gpu_hour" in v
                              else None),
            max_disk_price_micros=(usd_to_micros(v["max_disk_price_per_gb_month"])
                                   if "max_disk_price_per_gb_month" in v else None),
        )
        return self._render(instance, status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def destroy(self, request, pk=None):
        return self._render(svc.instance_destroy(instance=self.get_object()), status.HTTP_202_ACCEPTED)

    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        return self._render(svc.instance_stop(instance=self.get_object()), status.HTTP_202_ACCEPTED)

    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        return self._render(svc.instance_start(instance=self.get_object()), status.HTTP_202_ACCEPTED)

    @action(detail=True, methods=["post"])
    def restart(self, request, pk=None):
        return self._render(svc.instance_restart(instance=self.get_object()), status.HTTP_202_ACCEPTED)


    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        instance = self.get_object()  # another's instance is a 404 whatever the parameters
        reject_unknown_params(request, {"tail"})
        tail = opts.clean_logs_tail(request.query_params.get("tail"))
        return Response({"id": instance.pk, "lines": vm_logs(instance=instance, tail=tail)})
