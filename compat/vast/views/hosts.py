"""The host side: `show machines`, `list machine`, `unlist machine` over the provider's own nodes."""
from decimal import Decimal, InvalidOperation
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from core.api.scopes import PROVIDER_ONLY
from core.errors import NotFound, ValidationFailed
from marketplace import selectors
from marketplace.models import Gpu, GpuStatus, Node, SliceStatus
from marketplace.services import nodes as node_svc
from marketplace.validators import DISK_PRICE_LIMITS, PRICE_LIMITS

from .. import offers, query
from .base import VastView, _body, _refuse_unknown, _user


def gpu_mark(gpu: Gpu, slices_rented: set[int]) -> str:
    """A GPU in `gpu_occupancy`: `R` rented (a GPU split into MIG slices, status `mig`, when one of its slices is
    rented), `x` out of service (status `unavailable`: it failed a check or its provider took it out; renters
    cannot book it, as /api/v1/offers/' num_gpus_free counts), `_` free."""
    if gpu.status == GpuStatus.RENTED or gpu.pk in slices_rented:
        return "R"
    if gpu.status == GpuStatus.UNAVAILABLE:
        return "x"
    return "_"


def machine_row(node: Node) -> dict[str, Any]:
    slices_rented = {s.gpu_id for s in node.mig_slices.all() if s.status == SliceStatus.RENTED}
    return {
        "id": node.pk, "machine_id": node.pk, "hostname": node.name, "num_gpus": node.gpu_count,
        "gpu_name": node.gpu_model.name, "gpu_ram": node.gpu_model.memory_mib, "public_ipaddr": node.address,
        "geolocation": str(node.country) or None, "reliability2": node.reliability, "verification": node.verdict,
        "state": node.state, "listed": node.listed, "listed_gpu_cost": offers.usd(node.price_per_gpu_hour_micros),
        "gpu_occupancy": " ".join(gpu_mark(gpu, slices_rented) for gpu in node.gpus.all()),
    }


def _own_nodes(request: Request):
    # The CLI asks `owner=me`: an operator's view of every node (nodes_for_user) is narrowed to their own.
    return selectors.nodes_for_user(user=_user(request)).filter(provider=_user(request))


def _own_node(request: Request, node_id: Any) -> Node:
    # An id of the body as any count of the API (compat.vast.query.whole): 7.0 too; the path's is digits already.
    node_id = query.whole(node_id, "machine", low=0, high=10**18 - 1, words="a machine id")
    node = _own_nodes(request).filter(pk=node_id).first()
    if node is None:
        raise NotFound(f"No machine {node_id} of yours.")
    return node


class MachinesView(VastView):
    """GET /api/v0/machines?owner=me: `vastai show machines`."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py

    def get(self, request):
        return Response({"machines": [machine_row(n) for n in _own_nodes(request).order_by("id")]})


class MachineView(VastView):
    """GET /api/v0/machines/ID: `vastai show machine ID` (a list of one, as Vast answers)."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py

    def get(self, request, node_id: int):
        return Response([machine_row(_own_node(request, node_id))])


def _usd(body: dict[str, Any], name: str, limits: dict[str, Decimal], unit: str) -> Decimal | None:
    """A price of the body as Decimal USD to the micro (the API's UsdField places), within `limits`; None when not
    given. A bool, text that is no number, NaN, an infinity or a value out of range is a 400 naming the field."""
    raw = body.get(name)
    if raw is None:
        return None
    try:
        price = Decimal(str(raw)) if not isinstance(raw, bool) else None
    except InvalidOperation:
        price = None
    if price is None or not price.is_finite() or not limits["min_value"] <= price <= limits["max_value"]:
        raise ValidationFailed(f"{name} is USD {unit}, from {limits['min_value']} to {limits['max_value']}.",
                               field=name)
    return price.quantize(Decimal("0.000001"))


class MachineListView(VastView):
    """PUT /api/v0/machines/create_asks/: `vastai list machine ID -g PRICE -s DISK_PRICE` lists the node (at those
    prices: per GPU-hour, and per GB-month for disks, as PATCH /api/v1/nodes/ID/ sets them)."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py
    unsupported = {"price_inetu": "-u", "price_inetd": "-d", "price_min_bid": "-b",
                   "end_date": "-e", "credit_discount_max": "-r", "duration": "-l", "vol_size": "-v",
                   "vol_price": "-z"}

    def put(self, request):
        body = _body(request)
        _refuse_unknown(body, {"machine", "price_gpu", "price_disk", "min_chunk"} | set(self.unsupported))
        for name, flag in self.unsupported.items():
            if body.get(name) is not None:
                raise ValidationFailed(f"{name} ({flag}) is not offered here: a node has a price per GPU-hour (-g) "
                                       "and one per GB-month of disk (-s), and no bandwidth, bid, discount, "
                                       "end-date or volume offer prices.", field=name)
        min_chunk = body.get("min_chunk")
        # By type: True and 1.0 equal 1 in Python, and neither is a GPU count.
        if min_chunk is not None and (type(min_chunk) is not int or min_chunk != 1):
            raise ValidationFailed("Renters book any number of a node's GPUs here: min_chunk is 1.",
                                   field="min_chunk")
        node = _own_node(request, body.get("machine"))
        price = _usd(body, "price_gpu", PRICE_LIMITS, "per GPU-hour")
        disk_price = _usd(body, "price_disk", DISK_PRICE_LIMITS, "per GB per month of disk")
        node_svc.node_update(node=node, price_per_gpu_hour=price, disk_price_per_gb_month=disk_price, listed=True)
        return Response({"success": True, "extended": 0})


class MachineUnlistView(VastView):
    """DELETE /api/v0/machines/ID/asks/: `vastai unlist machine ID`."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py

    def delete(self, request, node_id: int):
        node_svc.node_update(node=_own_node(request, node_id), listed=False)
        return Response({"success": True})
