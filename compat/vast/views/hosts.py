"""The host side: `show machines`, `list machine`, `unlist machine` over the provider's own nodes."""
from decimal import Decimal, InvalidOperation
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from core.api.scopes import PROVIDER_ONLY
from core.errors import NotFound, ValidationFailed
from marketplace import selectors
from marketplace.models import GpuStatus, Node, SliceStatus
from marketplace.services import nodes as node_svc
from marketplace.validators import PRICE_LIMITS

from .. import offers
from .base import VastView, _body, _refuse_unknown, _user


def machine_row(node: Node) -> dict[str, Any]:
    # A GPU split into MIG slices (status `mig`) is occupied when one of its slices is rented.
    slices_rented = {s.gpu_id for s in node.mig_slices.all() if s.status == SliceStatus.RENTED}
    return {
        "id": node.pk, "machine_id": node.pk, "hostname": node.name, "num_gpus": node.gpu_count,
        "gpu_name": node.gpu_model.name, "gpu_ram": node.gpu_model.memory_mib, "public_ipaddr": node.address,
        "geolocation": str(node.country) or None, "reliability2": node.reliability, "verification": node.verdict,
        "state": node.state, "listed": node.listed, "listed_gpu_cost": offers.usd(node.price_per_gpu_hour_micros),
        "gpu_occupancy": " ".join("R" if gpu.status == GpuStatus.RENTED or gpu.pk in slices_rented else "_"
                                  for gpu in node.gpus.all()),
    }


def _own_nodes(request: Request):
    # The CLI asks `owner=me`: an operator's view of every node (nodes_for_user) is narrowed to their own.
    return selectors.nodes_for_user(user=_user(request)).filter(provider=_user(request))


def _own_node(request: Request, node_id: Any) -> Node:
    if isinstance(node_id, bool) or not isinstance(node_id, int):
        raise ValidationFailed("`machine` is a machine id.", field="machine")
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


class MachineListView(VastView):
    """PUT /api/v0/machines/create_asks/: `vastai list machine ID -g PRICE` lists the node (at that price)."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py
    unsupported = {"price_disk": "-s", "price_inetu": "-u", "price_inetd": "-d", "price_min_bid": "-b",
                   "end_date": "-e", "credit_discount_max": "-r", "duration": "-l", "vol_size": "-v",
                   "vol_price": "-z"}

    def put(self, request):
        body = _body(request)
        _refuse_unknown(body, {"machine", "price_gpu", "min_chunk"} | set(self.unsupported))
        for name, flag in self.unsupported.items():
            if body.get(name) is not None:
                raise ValidationFailed(f"{name} ({flag}) is not offered here: a node has one price, per GPU-hour.",
                                       field=name)
        min_chunk = body.get("min_chunk")
        # By type: True and 1.0 equal 1 in Python, and neither is a GPU count.
        if min_chunk is not None and (type(min_chunk) is not int or min_chunk != 1):
            raise ValidationFailed("Renters book any number of a node's GPUs here: min_chunk is 1.",
                                   field="min_chunk")
        node = _own_node(request, body.get("machine"))
        price = None
        if body.get("price_gpu") is not None:
            raw = body["price_gpu"]
            try:
                price = Decimal(str(raw)) if not isinstance(raw, bool) else None
            except InvalidOperation:
                price = None
            if price is None or not price.is_finite() \
                    or not PRICE_LIMITS["min_value"] <= price <= PRICE_LIMITS["max_value"]:
                raise ValidationFailed(f"price_gpu is USD per GPU-hour, from {PRICE_LIMITS['min_value']} to "
                                       f"{PRICE_LIMITS['max_value']}.", field="price_gpu")
            price = price.quantize(Decimal("0.000001"))
        node_svc.node_update(node=node, price_per_gpu_hour=price, listed=True)
        return Response({"success": True, "extended": 0})


class MachineUnlistView(VastView):
    """DELETE /api/v0/machines/ID/asks/: `vastai unlist machine ID`."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py

    def delete(self, request, node_id: int):
        node_svc.node_update(node=_own_node(request, node_id), listed=False)
        return Response({"success": True})
