"""Renters' pages: offers, the GPU comparison, renting, and instances with their live state.

Thin: the offers page runs the API's own FilterSet (marketplace.api.offers.OfferFilter) over the same selector,
so filters and ordering are the API's; booking and every verb call marketplace.services.instances.
"""
import json
from urllib.parse import urlencode

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.messages.storage.base import BaseStorage
from django.core.paginator import Paginator
from django.http import Http404, QueryDict
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.crypto import get_random_string, salted_hmac
from django.utils.html import format_html
from django.views.decorators.debug import sensitive_post_parameters
from django.views.decorators.http import require_GET, require_http_methods

from billing.services.ledger import funds_required_micros
from core import charts
from core.errors import ApplicationError, IdempotencyKeyReused
from core.idempotency import web_idempotency_key
from core.web_errors import form_error, page_wording
from marketplace import selectors, stored_figures
from marketplace.api.offers import OfferFilter
from marketplace.models import GpuModel
from marketplace.money import usd_rate_text
from marketplace.reauth import with_form_status
from marketplace.services import instances as svc
from marketplace.services import ssh_keys as ssh_svc
from marketplace.templatetags.marketplace_web import duration, usd, usd_rate, usd_up

from .figures import COMPARED, WORKLOAD, gpu_comparison
from .forms import RentForm, shown_disk_price_text, shown_prices_text, unit_price_map
from .rent_options import OPTION_FIELDS

OFFERS_PER_PAGE = 20

ORDERING_LABELS = {
    "": "Best value (score per $, default)",
    "price_per_gpu_hour": "Price: lowest first",
    "-price_per_gpu_hour": "Price: highest first",
    "score": "Score: lowest first",
    "-score": "Score: highest first",
    "score_per_dollar": "Score per $: lowest first",
    "-score_per_dollar": "Score per $: highest first",
    "reliability": "Reliability: lowest first",
    "-reliability": "Reliability: highest first",
    **{f"{sign}{name}": f"{label}: {'highest' if sign else 'lowest'} first" for sign in ("-", "") for name, label in (
        ("cuda_version", "CUDA version"), ("cpu_cores", "CPU threads"), ("ram_gb", "RAM"),
        ("disk_free_gb", "Free disk"), ("disk_bandwidth_mbs", "Disk speed"), ("pcie_gen", "PCIe generation"),
        ("pcie_width", "PCIe width"), ("platform_to_node_mbps", "Network from the platform"))},
}
FILTER_LABELS = {
    "gpu_model": ("GPU model", "Any of the ticked models."),
    "min_gpus": ("At least this many free GPUs", "Free slices of that profile when a MIG slice is chosen."),
    "min_gpu_memory_gb": ("Memory per GPU, at least (GB)", "Per slice when a MIG slice is chosen."),
    "max_price_per_gpu_hour": ("Price per GPU-hour, at most (USD)",
                               "Per slice-hour when a MIG slice is chosen. Otherwise servers renting MIG slices only "
                               "(no whole GPU free) are left out."),
    "country": ("Country", ""),
    "city": ("City", ""),
    "min_reliability": ("Reliability, at least (0 to 1)", "Share of health checks answered, e.g. 0.95."),
    "min_score": ("Score, at least", "Measured performance per GPU; 100 = an A100 80GB SXM at its datasheet."),
    "min_cuda_version": ("CUDA version, at least", "What the server's driver runs, e.g. 12.2."),
    "min_cpu_cores": ("CPU threads, at least", ""),
    "min_ram_gb": ("RAM, at least (GiB)", ""),  # ram_gb is GiB (MiB / 1024), as the API says
    "min_disk_free_gb": ("Free disk, at least (GB)", "What a booking can still ask for: the server's free disk "
                                                     "less what was promised there since its last check."),
    "min_disk_bandwidth_mbs": ("Disk speed, at least (MB/s)", "Measured by the check: the slower of write and read."),
    "min_pcie_gen": ("PCIe generation, at least", ""),
    "min_pcie_width": ("PCIe lanes, at least", "e.g. 16 for ×16."),
    "min_platform_to_node_mbps": ("Network, at least (Mbit/s)", "Measured by the platform to the server over SSH."),
    "nvlink": ("NVLink", "As the check found it: GPUs joined by NVLink, or not."),
    "mig_profile": ("MIG slice", "Only servers with a free MIG slice of this profile (a part of an A100, H100 or "
                                 "H200 rented on its own)."),
    "ordering": ("Sort by", ""),
}


class WebOfferFilter(OfferFilter):
    """The API's offer filters, with labels and widgets for people. Same fields, same SQL."""

    @property
    def form(self):
        form = super().form
        if not getattr(form, "_for_people", False):
            form._for_people = True
            for name, (label, help_text) in FILTER_LABELS.items():
                form.fields[name].label, form.fields[name].help_text = label, help_text
            models = form.fields["gpu_model"]
            models.widget = forms.CheckboxSelectMultiple()
            models.widget.choices = models.choices
            models.label_from_instance = lambda m: m.name
            ordering = form.fields["ordering"]
            ordering.choices = [(value, ORDERING_LABELS.get(value, label)) for value, label in ordering.choices
                                if value]
            ordering.empty_label = ORDERING_LABELS[""]
            nvlink = form.fields["nvlink"]
            nvlink.choices = [("", "Either"), ("true", "NVLink-connected"), ("false", "Without NVLink")]
            mig = form.fields["mig_profile"]
            mig.choices = [("", "Any (whole GPUs too)"), *((v, n) for v, n in mig.choices if v)]
            country = form.fields["country"]
            country.empty_label = None
            country.choices = [("", "Any country"), *((code, name) for code, name in country.choices if code)]
            for name in ("min_reliability", "min_score", "max_price_per_gpu_hour", "min_disk_bandwidth_mbs",
                         "min_platform_to_node_mbps"):
                form.fields[name].widget.attrs["step"] = "any"
        return form


def _filter_params(query: QueryDict) -> QueryDict:
    """The query without empty values and the page number: a web form sends every field, filled or not,
    while the API's FilterSet takes a parameter given without a value as a mistake."""
    cleaned = QueryDict(mutable=True)
    for name in OfferFilter.base_filters:
        values = [v for v in query.getlist(name) if v.strip()]
        if values:
            cleaned.setlist(name, values)
    return cleaned


def _with_free_slices(rows) -> None:
    """Set each offer's `mig_free`: [(profile, free slices, price per slice-hour in micros)], one query; only
    profiles the node prices (a missing price is never shown as 0: offer_rows.mig_slices). And `slices_only`: no
    whole GPU free, so that the page shows its slice prices, not a per-GPU-hour price nobody can book (found by
    review), with `cheapest_slice_micros` for the Rent button's label."""
    free = selectors.free_slices_by_node([o.pk for o in rows if o.mig_prices_micros])
    for offer in rows:
        prices = offer.mig_prices_micros
        offer.mig_free = [(profile, n, prices[profile])
                          for profile, n in sorted(free.get(offer.pk, {}).items()) if profile in prices]
        offer.slices_only = not offer.num_gpus_free and bool(offer.mig_free)
        offer.cheapest_slice_micros = min((price for _, _, price in offer.mig_free), default=None)


def _with_nvlink(rows) -> None:
    """Set each offer's `nvlink_figures`: its stored NVLink summary as the API writes it (stored_figures.summary),
    each value null unless of its kind: a stored figure beyond a float's range was printed as "inf", or with all its
    400 digits, and one stored as text ("400") or a `connected` of "yes" was shown as measured (found by review)."""
    for offer in rows:
        offer.nvlink_figures = (stored_figures.summary(offer.benchmark_summary) or {}).get("nvlink")


@require_GET
def offers(request):
    params = _filter_params(request.GET)
    filterset = WebOfferFilter(params, queryset=selectors.offers_search())
    valid = filterset.is_valid()
    results = filterset.qs if valid else selectors.offers_search().none()
    page = Paginator(results, OFFERS_PER_PAGE).get_page(request.GET.get("page"))
    # The page's free MIG slices, one query (none when no row rents slices), as "2 × 1g.10gb $0.25/h" lines.
    _with_free_slices(page.object_list)
    _with_nvlink(page.object_list)
    return render(request, "marketplace/offers.html", {
        "filter": filterset, "form": filterset.form, "page": page, "query": params.urlencode(),
        "filtered": bool(params), "valid": valid,
        # Filtered by a MIG profile: each Rent link opens the form with that profile chosen.
        "rent_query": urlencode({"mig_profile": filterset.form.cleaned_data.get("mig_profile")})
        if valid and filterset.form.cleaned_data.get("mig_profile") else "",
    }, status=200 if valid else 400)


@require_GET
def gpu_compare(request):
    every = GpuModel.objects.order_by("bf16_tflops", "name")
    chosen = [slug for slug in request.GET.getlist("models") if slug]
    models = every.filter(slug__in=chosen) if chosen else every
    columns = gpu_comparison(models)
    if not chosen:  # by default: the models people can rent now, else the whole catalogue
        offered = [c for c in columns if c.offers]
        columns = offered or columns
    price_chart = charts.hbar_chart(
        [charts.Group("", [charts.Bar(c.model.name, c.cheapest_per_tflop, "ok" if c.best_value else "",
                                      _cents(c.cheapest_per_tflop) if c.cheapest_per_tflop is not None
                                      else "MIG slices only" if c.offers else "no offer now") for c in columns])],
        title="US cents per BF16 TFLOP/s per hour at the cheapest offer (lower is better)",
    )
    share_chart = charts.hbar_chart(
        [charts.Group(c.model.name, [
            charts.Bar(label, c.measured_share(key, sheet_field), "",
                       f"{c.measured_share(key, sheet_field):.0%}" if c.measured_share(key, sheet_field) else
                       "not measured yet")
            for key, sheet_field, label, _ in COMPARED if key in ("bf16_tflops", "memory_bandwidth_gbs")
        ]) for c in columns],
        title="Measured median as a share of the datasheet", max_value=1.1,
        markers=[(1.0, "datasheet", "")],
    )
    return render(request, "marketplace/gpu_compare.html", {
        "columns": columns, "every": every, "chosen": set(chosen), "table": _compare_table(columns),
        "price_chart": price_chart, "share_chart": share_chart,
    })


NOT_MEASURED = format_html('<span class="muted">{}</span>', "not measured yet")


def _cents(usd_value: float) -> str:
    """A price per TFLOP/s-hour is a fraction of a cent: shown in cents ("0.38 ¢"), never as "$0.0038", so that
    no page shows dollars with more than two decimals."""
    return f"{usd_value * 100:.2f} ¢"


def _num(value, places=1):
    return "–" if value is None else f"{value:,.{places}f}"


def _per_watt(c) -> str:
    """Measured BF16 per watt with the number of servers behind it; never the datasheet's."""
    if not c.per_watt:
        return NOT_MEASURED
    servers = f"{c.per_watt_nodes} server{'s' if c.per_watt_nodes != 1 else ''}"
    return format_html('{} <span class="muted small">({})</span>', _num(c.per_watt * 1000, 0), servers)


def _compare_table(columns) -> list[dict]:
    """The comparison as rows of cells, models side by side: datasheet, measured here, price now."""
    def row(label, cell, note=""):
        return {"label": label, "note": note, "cells": [cell(c) for c in columns]}

    def measured(key, sheet_field):
        def cell(c):
            value = c.measured.get(key)
            if not value:
                return NOT_MEASURED
            share = c.measured_share(key, sheet_field)
            return format_html('{} <span class="muted small">({})</span>', _num(value), f"{share:.0%}") if share \
                else _num(value)
        return cell

    def per_tflop(attr):
        def cell(c):
            value = getattr(c, attr)
            if value is None:
                return "–"
            return format_html('{} <span class="muted small">({})</span>', _cents(value), c.bf16_basis[1])
        return cell

    def offers(c):
        if not c.offers:
            return format_html('<span class="muted">{}</span>', "none now")
        url = reverse("offers") + "?" + urlencode({"gpu_model": c.model.slug})
        whole = c.offers - c.slice_only_offers
        if not c.slice_only_offers:
            return format_html('<a href="{}">{} ({} GPUs free)</a>', url, whole, c.gpus_free)
        # Slices are priced per slice-hour, never per GPU-hour: counted apart, and left out of the prices below.
        slices = f"{c.slice_only_offers} with MIG slices only"
        if not whole:
            return format_html('<a href="{}">{}</a>', url, slices)
        return format_html('<a href="{}">{} ({} GPUs free), {}</a>', url, whole, c.gpus_free, slices)

    return [
        {"title": "Datasheet (dense, no sparsity)", "rows": [
            row("Architecture", lambda c: f"{c.model.architecture} · {c.model.get_form_factor_display()}"),
            row("Memory per GPU", lambda c: f"{c.model.memory_gb} GB {c.model.memory_type}"),
            *[row(f"{label} ({unit})", lambda c, f=sheet_field: _num(getattr(c.model, f)))
              for _, sheet_field, label, unit in COMPARED],
            row("Power (TDP)", lambda c: f"{c.model.tdp_w} W"),
            row("MIG", lambda c: f"up to {c.model.mig_max_instances}" if c.model.mig_supported else "no"),
        ]},
        {"title": "Measured here (median over the listed servers' latest checks)", "rows": [
            row("Servers measured", lambda c: str(c.nodes_measured)),
            *[row(f"{label} ({unit})", measured(key, sheet_field), "share of datasheet")
              for key, sheet_field, label, unit in COMPARED],
            *[row(f"{label} ({unit})", lambda c, k=key: _num(c.measured.get(k), 0) if c.measured.get(k)
                  else NOT_MEASURED, "small CNN, PyTorch") for key, label, unit in WORKLOAD],
            row("BF16 per watt (GFLOP/s per W)", _per_watt, "verified servers, at the most drawn under load"),
            row("Score per GPU", lambda c: _num(c.score) if c.score else NOT_MEASURED,
                "100 = A100 80GB SXM datasheet"),
        ]},
        {"title": "Price now", "rows": [
            row("Offers", offers),
            row("Cheapest per GPU-hour", lambda c: usd_rate(c.cheapest_micros), "a whole GPU"),
            row("Median per GPU-hour", lambda c: usd_rate(c.median_micros)),
            row("Per BF16 TFLOP/s-hour, cheapest", per_tflop("cheapest_per_tflop"), "lower is better"),
            row("Per BF16 TFLOP/s-hour, median", per_tflop("median_per_tflop")),
        ]},
    ]


# ------------------------------------------------------------------------------------------- renting

def _offer_or_404(node_id: int):
    offer = selectors.offers_search().filter(pk=node_id).first()
    if offer is None:
        raise Http404("This offer is not available now.")
    _with_free_slices([offer])
    return offer


def _funds(user, unit_price_micros: int) -> dict:
    """The renter's balance against what renting one GPU (or one MIG slice) of this offer needs: the booking's
    own funds check (one hour of all their running and starting instances and their storage plus this one)."""
    return _funds_figures(svc.funds_for(renter_id=user.pk, price_per_hour_micros=unit_price_micros))


def _funds_figures(funds: svc.Funds) -> dict:
    return {"balance_micros": funds.balance_micros, "required_micros": funds.required_micros,
            "missing_micros": funds.missing_micros, "enforced": funds.enforced, "required_s": funds.required_s,
            "per_gpu_micros": funds_required_micros(price_per_hour_micros=funds.added_rate_micros),
            "committed_rate_micros": funds.committed_rate_micros,
            "committed_micros": funds_required_micros(price_per_hour_micros=funds.committed_rate_micros),
            "suggested_usd": max(-(-funds.missing_micros // 1_000_000), int(settings.BILLING_TOP_UP_MIN_USD))}


def _funds_by_unit(funds: dict, offer) -> str:
    """The funds panel's words for each unit the form offers ("" = a whole GPU), as JSON: site.js swaps them in
    when the renter picks another MIG profile. The same rule as _funds, on the balance and committed rate it read."""
    words = {}
    for profile, price in _unit_price_map(offer).items():
        figures = _funds_figures(svc.funds_of(balance_micros=funds["balance_micros"], price_per_hour_micros=price,
                                              committed_rate_micros=funds["committed_rate_micros"]))
        words[profile] = {"per_unit": usd_up(figures["per_gpu_micros"]), "per": "slice" if profile else "GPU",
                          "missing": usd_up(figures["missing_micros"]) if figures["missing_micros"] else "",
                          "top_up": figures["suggested_usd"]}
    return json.dumps(words)


@page_wording(svc.InsufficientFunds)
def funds_refusal(exc: svc.InsufficientFunds) -> str:
    """The 402 of renting, starting or creating a volume in a page's words (the service's message names the API's
    endpoint)."""
    funds = exc.funds
    if funds.committed_rate_micros:
        rate = (f"your running and starting instances and your storage cost "
                f"{usd_rate(funds.committed_rate_micros)} per hour, {usd_rate(funds.rate_micros)} with this one")
    else:
        rate = f"this {funds.thing} costs {usd_rate(funds.added_rate_micros)} per hour"
    return (f"Not enough balance: {rate}, and {duration(funds.required_s)} of that is {usd_up(funds.required_micros)}. "
            f"Your balance is {usd(funds.balance_micros)}: top up at least {usd_up(funds.missing_micros)} "
            "on the Balance page.")


def _estimate(funds: dict, unit_price_micros: int, num_gpus: int, profile: str) -> dict:
    """What booking `num_gpus` GPUs (or MIG slices of `profile`) costs per hour, and how long the balance lasts at
    the renter's whole burn rate with it (the funds check's figures: their running and starting instances and their
    storage plus this one). site.js redoes the sum from the data-* figures when the number or the profile changes."""
    per_hour = unit_price_micros * num_gpus
    total = funds["committed_rate_micros"] + per_hour
    balance = funds["balance_micros"]
    unit = f"MIG {profile} slice" if profile else "GPU"
    return {"num_gpus": num_gpus, "per_hour_micros": per_hour, "total_rate_micros": total,
            "unit_price_micros": unit_price_micros, "unit": unit, "per": "slice" if profile else "GPU",
            "units": f"{num_gpus} {unit}{'s' if num_gpus != 1 else ''}",
            "lasts_s": balance * 3600 // total if balance > 0 and total else 0}


def _chosen_gpus(form) -> int:
    """The number of GPUs the form asks for (1 until it names a valid one)."""
    field = form.fields["num_gpus"]
    try:
        value = int(form["num_gpus"].value() or 1)
    except (TypeError, ValueError):
        return 1
    return value if 1 <= value <= (field.max_value or value) else 1


def _unit_price_map(offer) -> dict[str, int]:
    """Price per hour of one unit by choice ("" = a whole GPU)."""
    return unit_price_map(offer)


def _unit_prices(offer) -> str:
    """_unit_price_map as JSON, for site.js's estimate."""
    return json.dumps(_unit_price_map(offer))


def _price_raised(form, offer) -> str:
    """The note that the chosen unit, or the disk, costs more now than the page the form came from showed (its
    `shown_prices`, `shown_disk_price`), or "": the booking refuses such a price (PriceChanged), and this page
    shows the new one to be agreed to."""
    if not form.is_bound or form.errors.get("shown_prices") or form.errors.get("shown_disk_price"):
        return ""
    raised = []
    profile = form.chosen_profile()
    agreed = (form.cleaned_data.get("shown_prices") or {}).get(profile)
    now = unit_price_map(offer).get(profile)
    if agreed is not None and now is not None and now > agreed:
        unit = f"MIG {profile} slice-hour" if profile else "GPU-hour"
        raised.append(f"this offer now costs {usd_rate_text(now)} per {unit}, not the {usd_rate_text(agreed)} shown")
    disk_agreed, disk_now = form.cleaned_data.get("shown_disk_price"), int(offer.disk_price_per_gb_month_micros)
    if disk_agreed is not None and disk_now > disk_agreed:
        raised.append(f"its disk now costs {usd_rate_text(disk_now)} per GB-month (billed while the instance is "
                      f"stopped), not the {usd_rate_text(disk_agreed)} shown")
    if not raised:
        return ""
    return (f"The price changed since the page was shown: {', and '.join(raised)}. Nothing was booked. Check the new "
            f"price{'s' if len(raised) > 1 else ''} on this page and press “Rent now” again to book at "
            f"{'them' if len(raised) > 1 else 'it'}, or pick another offer.")


def _render_rent(request, offer, form, status=200):
    if note := _price_raised(form, offer):  # any page sent back, also one refused for another reason
        form.add_error(None, note)
    unit_price = form.unit_price_micros(offer)
    funds = _funds(request.user, unit_price)
    advanced_open = form.options_given() or any(name in form.errors for name in OPTION_FIELDS)
    volumes_open = form.volumes_given() or any(name == "volumes" or name.startswith("mount_") for name in form.errors)
    return render(request, "marketplace/rent.html", {
        "offer": offer, "form": form, "funds": funds,
        "estimate": _estimate(funds, unit_price, _chosen_gpus(form), form.chosen_profile()),
        "unit_prices": _unit_prices(offer), "funds_by_unit": _funds_by_unit(funds, offer) if offer.mig_free else "",
        "shown_prices": shown_prices_text(offer),  # what this page shows: the most its form agrees to pay
        "shown_disk_price": shown_disk_price_text(offer),  # likewise for the disk (host_facts shows it)
        "advanced_open": advanced_open, "volumes_open": volumes_open,
    }, status=status)


def _fingerprint_body(post, node_id: int) -> dict:
    """The posted form for the double-booking check, with no plain hash of a registry password, env or onstart
    script in it (and not the account's password at all: it saves a key, it does not shape the booking). The offer
    is in the URL, not the form: it goes in too, so that a token sent again for another offer is other choices, not
    a replay.

    The onstart script is a secret as the env is (renters put tokens in it; core/admin_site.SECRET_FIELDS): in the
    plain SHA-256 the instance stores, shown on its admin page with every other field of the form, a guess at it
    could be checked offline (found by review). An empty one stays as posted, so the fingerprints of bookings
    without a script are those stored before; one booked with a script before this and sent again is "other
    choices" (the form says so): nothing is booked twice."""
    keyed = ("registry_password", "env", "onstart")
    body = {k: v for k, v in post.lists()
            if k not in ("csrfmiddlewaretoken", "save_key_password", *keyed) or (k == "onstart" and not any(v))}
    for name in keyed:
        if post.get(name):
            body[name] = salted_hmac(f"rent-{name.replace('_', '-')}", post[name]).hexdigest()
    body["offer"] = node_id
    return body


def _booked_message(request, instance, *, again: bool = False) -> None:
    """Says the booking is made; `again` (a form sent again) only where the first sending's word is not still
    waiting to be shown (a double click: the browser left the first answer's redirect unfollowed)."""
    text = f"Instance {instance.pk} booked: the node is preparing it."
    if again:
        storage = messages.get_messages(request)
        waiting = any(str(m) == text for m in storage)
        if isinstance(storage, BaseStorage):  # looked at, not shown: they stay for the next page (Django's way)
            storage.used = False
        if waiting:
            return
    messages.success(request, text)


def _replay(request, node_id: int):
    """The instance this form's token already booked (a double click's second request, a resent form), or None.

    Asked before the offer and the form are checked: the booking took the offer's last free GPU or slices, so the
    offers search, or the form's choice of free MIG profiles, would refuse the replay what the booking service
    gives it (create_once). The lookup is the renter's own (instance_for_idempotency_key); the same token with other
    choices or another offer raises IdempotencyKeyReused."""
    try:
        token = RentForm.base_fields["request_token"].clean(request.POST.get("request_token", ""))
    except forms.ValidationError:
        return None  # the form says so
    if not token:
        return None
    return svc.instance_for_idempotency_key(
        renter=request.user, idempotency_key=web_idempotency_key(token),
        request_fingerprint=svc.request_fingerprint(_fingerprint_body(request.POST, node_id)))


def _replayed(request, node_id: int):
    """A redirect to the instance this form already booked, the rent page saying that the form was used with other
    choices, or None (no booking made with this token)."""
    try:
        instance = _replay(request, node_id)
    except IdempotencyKeyReused:
        offer = _offer_or_404(node_id)
        form = _reused_form(request, offer)
        return with_form_status(_render_rent(request, offer, form, status=400), form)
    if instance is None:
        return None
    _booked_message(request, instance, again=True)
    return redirect("instance", pk=instance.pk)


def _reused_form(request, offer) -> RentForm:
    """This page's form was already used to book, with other choices (back button): the same choices with a fresh
    token, and the error saying so."""
    data = request.POST.copy()
    data["request_token"] = get_random_string(32)
    form = RentForm(data, user=request.user, node=offer, request=request)
    form.is_valid()
    form.add_error(None, "This form was already used to book an instance with other choices. "
                         "Check the choices below and book again.")
    return form


def _price_changed(request, offer, form, exc: svc.PriceChanged):
    """The rent page again (409) at the offer's price now, saying that it changed (_price_raised) and that nothing
    was booked; its form carries the new price, so sending it again books at it."""
    try:
        fresh = _offer_or_404(offer.pk)
    except Http404:
        fresh = offer
    if unit_price_map(fresh) != unit_price_map(offer):  # changed again meanwhile: the choices' labels too
        form = RentForm(request.POST, user=request.user, node=fresh, request=request)
        form.is_valid()
    if not _price_raised(form, fresh):  # cut again since the refusal: the service's words
        form_error(form, exc)
    response = with_form_status(_render_rent(request, fresh, form, status=409), form)
    if response.status_code == 400:
        response.status_code = 409
    return response


@sensitive_post_parameters("registry_password", "save_key_password")
@login_required
@require_http_methods(["GET", "POST"])
def rent(request, node_id: int):
    if request.method == "GET":
        offer = _offer_or_404(node_id)
        initial = {"request_token": get_random_string(32), "image": "pytorch-2-5"}
        if request.GET.get("mig_profile"):  # from the offers page filtered by a profile; the form keeps valid ones
            initial["mig_profile"] = request.GET["mig_profile"]
        form = RentForm(user=request.user, node=offer, initial=initial)
        return _render_rent(request, offer, form)
    # A form sent again gets what it booked before the offer's availability is asked (its booking may have taken
    # the last free GPU or slices): once first, and once more where the offer or the form refuses, as the original
    # may have committed in between.
    if (replayed := _replayed(request, node_id)) is not None:
        return replayed
    try:
        offer = _offer_or_404(node_id)
    except Http404:
        if (replayed := _replayed(request, node_id)) is not None:
            return replayed
        raise
    form = RentForm(request.POST, user=request.user, node=offer, request=request)
    if not form.is_valid():
        if (replayed := _replayed(request, node_id)) is not None:
            return replayed
        return with_form_status(_render_rent(request, offer, form, status=400), form)
    data = form.cleaned_data
    token = data.get("request_token") or ""
    body = _fingerprint_body(request.POST, offer.pk)
    try:
        instance, _ = svc.instance_create(
            renter=request.user, node_id=offer.pk, num_gpus=data["num_gpus"],
            image=data.get("own_image") or data["image"], options=form.options(),
            ssh_public_keys=form.public_keys(), disk_gb=data.get("disk_gb"), label=data.get("label") or "",
            idempotency_key=web_idempotency_key(token),
            request_fingerprint=svc.request_fingerprint(body) if token else "",
            volumes=data.get("volumes") or [], mig_profile=data.get("mig_profile") or "",
            max_price_micros=form.max_price_micros(), max_disk_price_micros=form.max_disk_price_micros(),
        )
    except IdempotencyKeyReused:
        form = _reused_form(request, offer)
    except svc.PriceChanged as exc:  # raised after this page read the offer: shown again at the price now
        return _price_changed(request, offer, form, exc)
    except ApplicationError as exc:  # InsufficientFunds in funds_refusal's words
        form_error(form, exc)
    else:
        _booked_message(request, instance)
        # Saved only once the booking is made: a refused one (no funds, an unverified address) saves nothing.
        if data.get("save_key") and data.get("ssh_public_key"):
            try:
                ssh_svc.ssh_key_create(user=request.user, public_key=data["ssh_public_key"])
            except ssh_svc.SshKeyExists:
                pass  # saved already: nothing to do
            except ApplicationError as exc:  # MAX_SAVED_SSH_KEYS saved: the booking stands, the key is unsaved
                messages.warning(request, f"The key was not saved to your SSH keys: {exc.message}")
        return redirect("instance", pk=instance.pk)
    return with_form_status(_render_rent(request, offer, form, status=400), form)
