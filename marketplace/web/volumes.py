"""Renters' volumes page: the list, creating one on an offer's node, deleting one (confirmed by typing its name).

Thin: marketplace.services.volumes does the work and says no (a Conflict while an instance mounts it)."""
from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.crypto import get_random_string
from django.views.decorators.http import require_http_methods, require_POST

from core.errors import ApplicationError, IdempotencyKeyReused
from core.idempotency import WEB_REQUEST_TOKEN_MAX_LENGTH, request_fingerprint, web_idempotency_key
from core.validators import no_control_characters
from core.web_errors import form_error, message_error
from marketplace.models import Node, Volume
from marketplace.models.nodes import offerable
from marketplace.models.volumes import MAX_VOLUME_GB
from marketplace.selectors import instances_awaiting_cleanup_by_node, volumes_with_given_back
from marketplace.services import volumes as svc
from marketplace.templatetags.marketplace_web import usd_rate
from marketplace.validators import NAME_MAX_LENGTH


def _offer_choices():
    """The servers the volume service takes (its rule, offer_rules.node_refusal, is models.nodes.offerable): a
    free GPU is not needed, so a renter whose instance holds a server's only GPU can put a volume beside it. The
    offers search (a free GPU or slice) left those out: "Select a valid choice" where the API said 201. Not a
    server whose VMs mount no volume (libvirt: svc.node_mounts_volumes), which the service refuses."""
    offers = (Node.objects.filter(offerable()).exclude(runtime__in=svc.VOLUMELESS_RUNTIMES)
              .select_related("gpu_model").order_by("country", "city", "pk")
              .only("city", "country", "disk_price_per_gb_month_micros", "gpu_model__name"))  # not its keys
    return [(o.pk, f"#{o.pk} · {o.gpu_model.name} · {o.city + ', ' if o.city else ''}{o.country.name} · "
                   f"{usd_rate(o.disk_price_per_gb_month_micros)} per GB-month") for o in offers]


class VolumeForm(forms.Form):
    offer = forms.TypedChoiceField(label="Server (offer)", coerce=int, choices=(),
                                   help_text="A volume lives on one server; instances on that server can mount "
                                             "it. Servers that run virtual machines (libvirt) are not listed: they "
                                             "cannot mount volumes yet.")
    size_gb = forms.IntegerField(label="Size (GB)", min_value=1, max_value=MAX_VOLUME_GB, initial=50)
    label = forms.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters])
    # Makes a double submission (a double click, a resent form) create one volume, billed once: the page's token.
    request_token = forms.CharField(widget=forms.HiddenInput, required=False,
                                    max_length=WEB_REQUEST_TOKEN_MAX_LENGTH)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["offer"].choices = _offer_choices()


@login_required
@require_http_methods(["GET", "POST"])
def volumes(request):
    form = VolumeForm(request.POST or None,
                      initial={"offer": request.GET.get("offer"), "request_token": get_random_string(32)})
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        token = data.get("request_token") or ""
        body = {k: v for k, v in request.POST.lists() if k != "csrfmiddlewaretoken"}
        try:
            volume, _ = svc.volume_create_once(
                owner=request.user, node_id=data["offer"], size_gb=data["size_gb"], label=data["label"],
                idempotency_key=web_idempotency_key(token),
                request_fingerprint=request_fingerprint(body) if token else "")
        except IdempotencyKeyReused:
            # This page's form already made a volume, with other choices (back button): a fresh token.
            fresh = request.POST.copy()
            fresh["request_token"] = get_random_string(32)
            form = VolumeForm(fresh)
            form.is_valid()
            form.add_error(None, "This form was already used to create a volume with other choices. Check them "
                                 "and create it again.")
        except ApplicationError as exc:
            form_error(form, exc)
        else:
            messages.success(request, f"Volume {volume.name} ({volume.size_gb} GB) is being created; it is billed "
                                      f"at {usd_rate(volume.price_per_gb_month_micros)} per GB-month once it exists.")
            return redirect("volumes")
    # What each cost so far, net of what was given back of its charges (the ledger's figure), in the list's query.
    listed = list(volumes_with_given_back(svc.volumes_for_user(user=request.user)).order_by("-created_at", "-id"))
    # The API's holders (what refuses a delete): also an instance whose VM is still to be removed from the node,
    # which the page left out (no holder shown, a delete offered and refused; found by review, r49). One read.
    leaving = instances_awaiting_cleanup_by_node(node_ids={v.node_id for v in listed})
    rows = [{"volume": v, "in_use_by": svc.volume_holder_ids(v, awaiting_cleanup=leaving),
             "paid": v.cost_micros - v.given_back_micros} for v in listed]
    return render(request, "marketplace/volumes.html", {"form": form, "rows": rows},
                  status=400 if form.errors else 200)


@login_required
@require_POST
def volume_delete(request, pk: int):
    volume = get_object_or_404(Volume, pk=pk, owner=request.user)
    try:
        svc.volume_delete(volume=volume, confirm=request.POST.get("confirm", "").strip())
    except ApplicationError as exc:
        message_error(request, exc)
    else:
        messages.success(request, f"Volume {volume.name} is being deleted; billing stopped now.")
    return redirect("volumes")
