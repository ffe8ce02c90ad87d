"""Renters' instance pages: the list, one instance with its live state, logs and details, and the verbs.

Thin: every verb calls marketplace.services.instances; the logs are read from the node by
provisioning.services.vms.vm_logs (the API's own), only when the renter asks for them.
"""
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from billing import selectors as billing_selectors
from core.errors import ApplicationError
from core.web_errors import message_error
from marketplace import selectors
from marketplace.models import InstanceStatus, InvalidTransition
from marketplace.models.renting import FINAL_STATUSES
from marketplace.services import instances as svc
from marketplace.services.instances import lifecycle as svc_lifecycle
from marketplace.services.instances import options as opts
from provisioning.models import OPEN_JOB_STATUSES, Job
from provisioning.services.vms import vm_logs

from . import renters  # noqa: F401 (registers the pages' wording of InsufficientFunds, shown by the verbs)

VERBS = {
    # verb: (service, button words, question, danger). The states that show a button are the instance table's
    # (`Instance.allows(verb)`, marketplace.models.renting), the same rule the service applies; start and restart
    # are also refused for their node's sake (NODE_REFUSALS), the service's own check, said instead of a button.
    "stop": (svc.instance_stop, "Stop", "Stop it? Its GPUs are freed and GPU time is no longer billed; the disk is "
                                        "kept, and billed at the server's storage price while stopped. Start it "
                                        "again later, or destroy it to end that charge.", False),
    "start": (svc.instance_start, "Start", "Start it again? It takes its GPUs back when they are free.", False),
    "restart": (svc.instance_restart, "Restart", "Restart it? Running programs are ended, the disk is kept.", False),
    "destroy": (svc.instance_destroy, "Destroy", "Destroy it? Its disk is deleted for good and its GPUs are freed.",
                True),
}
# The services' own checks of the node for a verb the instance's state allows ('' = the node takes it): found by
# review, the page offered Start on a node in maintenance and Restart on a quarantined one, and the click was refused.
NODE_REFUSALS = {"start": svc_lifecycle.instance_start_refusal, "restart": svc_lifecycle.instance_restart_refusal}
SETTLED = {InstanceStatus.RUNNING, InstanceStatus.STOPPED, InstanceStatus.INTERRUPTED}  # polled slowly


def _instance_or_404(user, pk: int):
    """The user's own instance; another user's is a 404, exactly like one that does not exist."""
    return get_object_or_404(svc.instances_for_user(user=user), pk=pk)


def _verbs(instance) -> tuple[list[dict], list[dict]]:
    """The verbs the page offers (the instance's state allows them and its node takes them), and those its state
    allows but its node refuses now, each with the service's reason."""
    offered, refused = [], []
    for verb, (_, words, question, danger) in VERBS.items():
        if not instance.allows(verb):
            continue
        check = NODE_REFUSALS.get(verb)
        reason = check(instance=instance) if check else ""
        if reason:
            refused.append({"verb": verb, "button": words, "reason": reason})
        else:
            offered.append({"verb": verb, "button": words, "question": question, "danger": danger,
                            "url": reverse("instance-verb", args=[instance.pk, verb])})
    return offered, refused


def _live_context(instance, user) -> dict:
    job = Job.objects.filter(instance=instance).order_by("-id").first()
    verbs, refused = _verbs(instance)
    return {
        "instance": instance,
        "status": billing_selectors.balance_status(user=user),  # the low-balance warning, as on the balance page
        "ssh_command": selectors.instance_ssh_command(instance),
        "gpus": svc.instance_gpu_indices(instance=instance),
        "job": job,
        "job_open": job is not None and job.status in OPEN_JOB_STATUSES,
        "final": instance.status in FINAL_STATUSES,
        "cost": billing_selectors.instance_cost(instance=instance),
        # What its disk costs a month while stopped (GB × the price per GB-month booked), said beside the cost.
        "disk_month_micros": instance.disk_gb * instance.disk_price_per_gb_month_micros,
        "verbs": verbs,
        "refused_verbs": refused,
    }


def _poll_headers(response, instance):
    if instance.status in FINAL_STATUSES:
        response["X-Poll-Stop"] = "1"
    elif instance.status in SETTLED:
        response["X-Poll-Interval"] = "10000"
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_GET
def instances(request):
    rows = svc.instances_for_user(user=request.user).select_related("node").order_by("-created_at", "-id")
    show_all = request.GET.get("show") == "all"
    if not show_all:
        rows = rows.exclude(status=InstanceStatus.DESTROYED)
    page = Paginator(rows, 25).get_page(request.GET.get("page"))
    return render(request, "marketplace/instances.html", {
        "page": page, "show_all": show_all, "status": billing_selectors.balance_status(user=request.user)})


@login_required
@require_GET
def instance(request, pk: int):
    obj = _instance_or_404(request.user, pk)
    context = _live_context(obj, request.user)
    context["node"] = obj.node
    context["mig_slices"] = svc.instance_slice_uuids(instance=obj) if obj.mig_profile else []  # prefetched
    context["no_log"] = _no_log(obj)
    context["logs"] = None if context["no_log"] else _logs(obj, request.GET.get("tail"))
    context["log_tails"] = LOG_TAILS
    return _poll_headers(render(request, "marketplace/instance.html", context), obj)


LOG_TAILS = (100, 1000, opts.LOGS_TAIL_MAX)


def _no_log(instance) -> str:
    """Why the instance has no log to read ('' when it may have one): where vm_logs would answer "no VM to read logs
    from", or the node has no VM of it any more, no link is offered (review r55 LOW-2: each link could only fail)."""
    if instance.status == InstanceStatus.REQUESTED:
        return "There is no log yet: its VM is not created yet."
    if instance.status == InstanceStatus.DESTROYED:
        return "There is no log: the instance is destroyed, and its VM with it."
    if instance.status == InstanceStatus.FAILED and instance.vm_gone:
        return "There is no log: its VM is no longer on its server."
    return ""


def _logs(instance, tail_param) -> dict | None:
    """The instance's log, read from its node when the page asks for it (`?tail=N`); None when not asked."""
    if tail_param is None:
        return None
    try:
        tail = opts.clean_logs_tail(tail_param)
        return {"tail": tail, "lines": vm_logs(instance=instance, tail=tail)}
    except ApplicationError as exc:
        return {"tail": None, "error": exc.message}


@login_required
@require_GET
def instance_live(request, pk: int):
    """The polled part of the instance page: its state, current step, SSH command and buttons."""
    obj = _instance_or_404(request.user, pk)
    context = _live_context(obj, request.user)
    return _poll_headers(render(request, "marketplace/includes/instance_live.html", context), obj)


@login_required
@require_POST
def instance_verb(request, pk: int, verb: str):
    obj = _instance_or_404(request.user, pk)
    if verb not in VERBS:
        raise Http404("No such action.")
    service = VERBS[verb][0]
    try:
        service(instance=obj)
    except InvalidTransition as exc:  # before ApplicationError: a Conflict, worded here as the state's answer
        messages.error(request, f"Not possible now: {exc}.")
    except ApplicationError as exc:  # InsufficientFunds in funds_refusal's words
        message_error(request, exc)
    else:
        messages.success(request, {"stop": "Stopping", "start": "Starting", "restart": "Restarting",
                                   "destroy": "Destroying"}[verb] + f" instance {obj.pk}.")
    return redirect("instance", pk=obj.pk)
