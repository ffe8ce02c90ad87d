"""Providers' pages: register a server, the servers list, a server's page with its benchmark history, and the
switches a provider has (price, listing, maintenance, verify now, retire). Thin: marketplace.services.nodes and
provisioning.services.verification hold the rules."""
import math

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from billing.selectors import earnings_by_node
from core import charts
from core.api.throttling import scoped_rate_wait
from core.errors import ApplicationError, TooManyRequests
from core.web_errors import form_error, message_error
from marketplace import selectors
from marketplace.mig import profiles_for
from marketplace.models import GpuModel, GpuStatus, Node, NodeState, SliceStatus, Verdict
from marketplace.services import nodes as svc
from marketplace.services.instances.mig import node_cards_pending_layout
from marketplace.templatetags.marketplace_web import usd_decimal
from provisioning.models import OPEN_JOB_STATUSES, Job
from provisioning.node_event_kinds import recent_events_for_provider
from provisioning.selectors import latest_jobs, verification_runs_of
from provisioning.services.endpoint_change import node_change, node_endpoint_changes
from provisioning.services.verification import node_verify_cooldown, node_verify_request
from provisioning.verification.model import DeclaredModel
from provisioning.verification.platform_figures import platform_checks
from provisioning.verification.tolerances import FIGURES, TOLERANCES
from provisioning.verification.wording import closest_model, reasons

from .figures import figure_bands, node_runs, run_shares
from .node_forms import NodeMigForm, NodeRegisterForm, NodeSettingsForm

# The per-GPU chart shows these (FP16 is the same tensor path as BF16); the table below it has every figure.
GPU_CHART_FIGURES = ("bf16_tflops", "tf32_tflops", "fp32_tflops", "memory_bandwidth_gbs")
VERDICT_CSS = {Verdict.VERIFIED: "ok", Verdict.DEGRADED: "warn", Verdict.REJECTED: "bad"}


def _own_nodes(user):
    """The user's own live nodes (operators look at everyone's in the admin)."""
    return selectors.nodes_for_user(user=user).filter(provider=user)


def _node_or_404(user, pk: int):
    node = _own_nodes(user).filter(pk=pk).first()
    if node is None:
        raise Http404("No such server.")
    return node


def _utilisation(node) -> dict:
    """The node's GPUs by status, and a split GPU's MIG slices apart (a split GPU is rented per slice, never whole:
    `whole` counts the others); `not_offered` says why its free ones are not bookable ("" when they are)."""
    gpus = list(node.gpus.all())
    split = {g.pk for g in gpus if g.status == GpuStatus.MIG}
    # Slices of a GPU no longer split stay as unavailable rows: only a split GPU's slices are on offer.
    slices = [s for s in node.mig_slices.all() if s.gpu_id in split]
    return {"total": len(gpus), "whole": len(gpus) - len(split), "split": len(split),
            "rented": sum(g.status == GpuStatus.RENTED for g in gpus),
            "free": sum(g.status == GpuStatus.FREE for g in gpus),
            "unavailable": sum(g.status == GpuStatus.UNAVAILABLE for g in gpus),
            "slices": len(slices), "slices_rented": sum(s.status == SliceStatus.RENTED for s in slices),
            "slices_free": sum(s.status == SliceStatus.FREE for s in slices),
            "slices_unavailable": sum(s.status == SliceStatus.UNAVAILABLE for s in slices),
            "not_offered": selectors.node_not_offered_reason(node)}


@login_required
@require_GET
def nodes(request):
    rows = list(_own_nodes(request.user).order_by("name", "id"))
    jobs = latest_jobs([n.pk for n in rows])
    runs = verification_runs_of(jobs.values())
    earned = earnings_by_node(user=request.user)
    items = [{"node": n, "use": _utilisation(n), "job": jobs.get(n.pk),
              "job_run": runs.get(jobs[n.pk].pk) if n.pk in jobs else None, "earned_micros": earned.get(n.pk, 0)}
             for n in rows]
    return render(request, "marketplace/nodes.html", {"items": items})


@login_required
@require_http_methods(["GET", "POST"])
def node_register(request):
    form = NodeRegisterForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        # Before the address's name is looked up: the API's rate and counter (svc.REGISTER_SCOPE), one budget.
        wait = scoped_rate_wait(request, svc.REGISTER_SCOPE)
        if wait is not None:
            form_error(form, TooManyRequests(svc.register_throttled(wait)))
            response = render(request, "marketplace/node_register.html", {"form": form}, status=429)
            response["Retry-After"] = str(max(1, math.ceil(wait)))
            return response
        try:
            node = svc.node_register(provider=request.user, **form.cleaned_data)
        except ApplicationError as exc:
            # A live node at that address under Address; a host key, the runtime or the address's checks on their
            # own fields; a refusal about the account (EmailNotVerified) or the cap on pending nodes above all.
            form_error(form, exc)
        else:
            messages.success(request, f"Server “{node.name}” registered. Install the platform's key on it, "
                                      "then verify it.")
            return redirect("node", pk=node.pk)
    return render(request, "marketplace/node_register.html", {"form": form}, status=400 if form.errors else 200)


# ------------------------------------------------------------------------------------------ a node

def _live_context(node, watching: str = "") -> dict:
    job = Job.objects.filter(node=node).order_by("-id").first()
    job_open = job is not None and job.status in OPEN_JOB_STATUSES
    job_run = verification_runs_of([job]).get(job.pk) if job is not None else None
    can_verify = not job_open and node.verify_allowed()
    return {
        "node": node,
        "job": job,
        "job_open": job_open,
        # The check the last verify job ran: the page says its verdict, not just that the job "succeeded".
        "job_run": job_run,
        "use": _utilisation(node),
        # The page was waiting on this job and it has ended: the page reloads to show the new figures.
        "reload": bool(watching) and not job_open,
        "can_verify": can_verify,
        # The provider's Verify waits NODE_VERIFY_COOLDOWN_S after a check with a verdict: the button says until when.
        "verify_cooldown": node_verify_cooldown(node) if can_verify else None,
        "can_retire": node.allows("retire"),
        # States whose cause is only in last_error (a verdict's reasons show with its check instead).
        "problem_states": (NodeState.OFFLINE, NodeState.QUARANTINED, NodeState.PENDING),
    }


def _gpu_chart(node, run):
    """Measured vs datasheet per GPU for one run, with the policy's floors as ticks on every bar."""
    bands = figure_bands()
    derived = DeclaredModel.from_gpu_model(node.gpu_model).derived
    groups = []
    for gpu in run.figures.get("gpus") or []:
        bars = []
        for key, (label, unit) in FIGURES.items():
            if key not in GPU_CHART_FIGURES:
                continue
            share = (gpu.get("of_datasheet") or {}).get(key)
            value = gpu.get(key)
            band = bands[key]
            slack = TOLERANCES["derived_floor_factor"] if key in derived else 1.0
            reject, degrade = band["reject"] * slack, band["degrade"] * slack
            css = "ok"
            if share is not None and (share < reject or (band["max"] and share > band["max"])):
                css = "bad"
            elif share is not None and share < degrade:
                css = "warn"
            text = f"{value:,.4g} {unit} · {share:.0%}" if share is not None and value else "not measured"
            bars.append(charts.Bar(label, share, css, text, ticks=[
                (reject, "bad", f"rejected below {reject:.0%}"),
                (degrade, "warn", f"degraded below {degrade:.0%}"),
            ]))
        groups.append(charts.Group(f"GPU {gpu.get('index', '?')}", bars))
    if not groups:
        return None
    return charts.hbar_chart(groups, title="Measured as a share of the datasheet, per GPU (latest check)",
                             max_value=1.2, markers=[(1.0, "datasheet", "")], row_h=18)


def _history_chart(runs):
    groups = []
    for run in reversed(runs):  # oldest first, reading down
        shares = run_shares(run)
        css = VERDICT_CSS.get(run.verdict, "neutral")
        groups.append(charts.Group(f"{run.created_at:%Y-%m-%d %H:%M} · {run.verdict}", [
            charts.Bar("BF16 (median)", shares.get("bf16_tflops"), css,
                       f"{shares['bf16_tflops']:.0%}" if shares.get("bf16_tflops") else "not measured"),
            charts.Bar("Bandwidth (median)", shares.get("memory_bandwidth_gbs"), css,
                       f"{shares['memory_bandwidth_gbs']:.0%}" if shares.get("memory_bandwidth_gbs")
                       else "not measured"),
        ]))
    if not groups:
        return None
    return charts.hbar_chart(groups, title="Benchmark history: the node's medians as a share of the datasheet",
                             max_value=1.2, markers=[(1.0, "datasheet", "")])


def _closest(node, run):
    """What the run's figures do match in the catalogue, when they do not pass as the model declared."""
    catalogue = [DeclaredModel.from_gpu_model(m) for m in GpuModel.objects.all()]
    return closest_model(catalogue, node.gpu_model.slug, run.figures, run.inventory)


def _settings_form(node, data=None):
    # The declared host key can be corrected until the node's first contact (node_update).
    return NodeSettingsForm(data, host_key_editable=node.control_proven_at is None, initial={
        "price_per_gpu_hour": usd_decimal(node.price_per_gpu_hour_micros), "listed": node.listed,
        "maintenance": node.state == NodeState.MAINTENANCE, "host_key_fingerprint": node.host_key_fingerprint,
        "address": node.address, "ssh_port": node.ssh_port, "ssh_user": node.ssh_user,
    })


def _mig_form(node, data=None):
    """The declared layout and prices as the form's lines (the API's JSON, one line per GPU and per profile)."""
    return NodeMigForm(data, initial={
        "mig_layout": "\n".join(f"GPU {e['gpu']}: {', '.join(e['profiles'])}" for e in node.mig_layout or []),
        "mig_prices": "\n".join(f"{name}: {usd_decimal(micros)}"
                                for name, micros in sorted((node.mig_prices_micros or {}).items())),
    })


RECENT_EVENTS = 20  # the server page's "Recent events"


def _render_node(request, node, settings_form=None, status=200, mig_form=None):
    runs = node_runs(node)
    for run in runs:  # the history's reasons: each code once, with the GPUs it concerns
        run.reasons = reasons(run.findings)
    latest = runs[0] if runs else None
    live = _live_context(node)
    findings = reasons(latest.findings) if latest else []
    context = {
        **live,
        "install_command": svc.node_install_command(node=node),
        "runs": runs,
        "latest": latest,
        "findings": findings,  # each said once, with the GPUs it concerns
        "match": _closest(node, latest) if latest and latest.verdict != Verdict.VERIFIED else None,
        "gpu_chart": _gpu_chart(node, latest) if latest else None,
        "platform": platform_checks(latest.figures) if latest else None,
        "history_chart": _history_chart(runs),
        "gpus": list(node.gpus.all()),
        "settings_form": settings_form or _settings_form(node),
        # MIG: for a model with profiles, or a node that declared a layout anyway (an old row)
        "mig_profiles": profiles_for(node.gpu_model.slug),
        "mig_form": mig_form or _mig_form(node),
        "mig_slices": list(node.mig_slices.select_related("gpu").order_by("gpu__index", "device")),
        # Cards whose declared layout waits for their renters (the check leaves them as they are meanwhile).
        "mig_pending": node_cards_pending_layout(node.pk),
        "poll_url": (reverse("node-live", args=[node.pk]) + (f"?watching={live['job'].pk}" if live["job_open"]
                                                             else "")),
        # The retire service's own refusal ('' = it would retire it): the button only where the click is taken.
        "retire_refusal": svc.node_retire_refusal(node=node) if live["can_retire"] else "",
        "needs_key": node.verdict == Verdict.UNVERIFIED and node.state in (NodeState.PENDING, NodeState.VERIFYING),
        # What happened to the server, as its provider may see it (the kinds, titles and safe messages of
        # provisioning/node_event_kinds.py; GET /api/v1/nodes/{id}/events/ has them all).
        "events": recent_events_for_provider(node_id=node.pk, limit=RECENT_EVENTS),
    }
    return render(request, "marketplace/node.html", context, status=status)


@login_required
@require_GET
def node(request, pk: int):
    return _render_node(request, _node_or_404(request.user, pk))


@login_required
@require_GET
def node_live(request, pk: int):
    """The polled part of the server's page: state, verdict, the current job and its steps."""
    node = _node_or_404(request.user, pk)
    context = _live_context(node, watching=request.GET.get("watching", ""))
    response = render(request, "marketplace/includes/node_live.html", context)
    if not context["job_open"]:
        response["X-Poll-Stop"] = "1"
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def node_verify(request, pk: int):
    node = _node_or_404(request.user, pk)
    try:
        node_verify_request(node=node, by_provider=True)
    except ApplicationError as exc:  # VerifyCooldown (when it may be asked again), a Conflict
        message_error(request, exc)
    else:
        messages.success(request, "Verification queued: the steps show below as the worker goes.")
    return redirect("node", pk=node.pk)


def _endpoint_saved(before: Node, stored: Node) -> str:
    """What the settings page says of a stored endpoint change: proven at the new address, or, for a node never
    contacted, its first contact there started (endpoint_change.node_change queues it: review r55 LOW-6)."""
    if (stored.address, stored.ssh_port, stored.ssh_user) == (before.address, before.ssh_port, before.ssh_user):
        return ""
    if before.control_proven_at is not None or before.state != NodeState.PENDING:
        return " The server answered at its new address with this node's host key."
    where = f"{stored.ssh_user}@{stored.address}:{stored.ssh_port}"
    if stored.state == NodeState.VERIFYING:
        return (f" A first contact with the server at {where} has started (its last error, about the old address, "
                "is cleared): its steps show below.")
    return f" Press “Verify now” for a first contact with the server at {where}."


@login_required
@require_POST
def node_settings(request, pk: int):
    node = _node_or_404(request.user, pk)
    form = _settings_form(node, request.POST)
    if form.is_valid():
        # Only what was changed on the page: the others may have been changed since it was opened.
        changed = {name: form.cleaned_data[name] for name in form.changed_since_shown()}
        endpoint = {name: changed.pop(name) for name in svc.ENDPOINT_FIELDS if name in changed}
        endpoint = {name: value for name, value in endpoint.items() if value not in ("", None)}
        if endpoint and node_endpoint_changes(node=node, **endpoint):
            # Before any check of the new endpoint: the API's rate and counter (svc.ENDPOINT_SCOPE), one budget.
            wait = scoped_rate_wait(request, svc.ENDPOINT_SCOPE)
            if wait is not None:
                form_error(form, TooManyRequests(svc.endpoint_throttled(wait)))
                response = _render_node(request, node, settings_form=form, status=429)
                response["Retry-After"] = str(max(1, math.ceil(wait)))
                return response
        try:
            # Every field checked, then the endpoint proven, then all stored together: refused, nothing is stored.
            stored = node_change(node=node, endpoint=endpoint, **changed)
        except ApplicationError as exc:  # a Conflict, InvalidTransition among them
            form_error(form, exc)
        else:
            messages.success(request, "Settings saved." + (_endpoint_saved(node, stored) if endpoint else ""))
            return redirect("node", pk=node.pk)
    return _render_node(request, node, settings_form=form, status=400)


@login_required
@require_POST
def node_mig(request, pk: int):
    """Declare or change the MIG layout and its prices: the same service call as PATCH /api/v1/nodes/{id}/."""
    node = _node_or_404(request.user, pk)
    form = _mig_form(node, request.POST)
    if form.is_valid():
        # Only what was changed on the page (the service keeps the other as stored, and checks the two together):
        # the layout or the prices may have been declared anew since it was opened.
        changed = form.changed_since_shown()
        try:
            if changed:
                svc.node_update(node=node, **{name: form.cleaned_data[name] for name in changed})
        except ApplicationError as exc:  # ValidationFailed naming mig_layout or mig_prices, a Conflict
            form_error(form, exc)
        else:
            if "mig_layout" in changed:
                messages.success(request, "MIG layout saved: the next check proves the slices; press “Verify now” "
                                          "to run it.")
            elif changed:
                messages.success(request, "MIG prices saved.")
            else:
                messages.info(request, "Nothing changed.")
            return redirect("node", pk=node.pk)
    return _render_node(request, node, mig_form=form, status=400)


@login_required
@require_POST
def node_retire(request, pk: int):
    node = _node_or_404(request.user, pk)
    try:
        svc.node_retire(node=node)
    except ApplicationError as exc:
        message_error(request, exc)
        return redirect("node", pk=node.pk)
    messages.success(request, f"Server “{node.name}” retired: it takes no rentals and is no longer checked.")
    return redirect("nodes")
