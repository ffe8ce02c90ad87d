"""A listed node whose GPUs are split into MIG slices, as a passed check leaves it (no SSH)."""
from decimal import Decimal

from django.db import transaction

from marketplace.models import Node
from provisioning.services.mig import node_apply_mig_slices
from tests.factories import make_listed_node

SEVEN = ["1g.10gb"] * 7  # the most 1g.10gb slices an A100 80GB holds: 7 compute and 7 memory slices


def slice_uuid(node_id: int, gpu: int, device: int) -> str:
    return f"MIG-{node_id:08d}-{gpu:04d}-{device:04d}-0000-000000000000"


def make_mig_node(layout: dict[int, list[str]], prices: dict[str, str] | None = None, gpu_count: int = 2,
                  **kwargs) -> Node:
    """An A100 80GB SXM node with `layout` declared and every slice proven by its check."""
    declared = [{"gpu": gpu, "profiles": profiles} for gpu, profiles in sorted(layout.items())]
    used = {p for profiles in layout.values() for p in profiles}
    prices = prices or {p: "0.200000" for p in used}
    decimal_prices = {name: Decimal(price) for name, price in prices.items()}
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=gpu_count, mig_layout=declared,
                            mig_prices=decimal_prices, **kwargs)
    prove(node, layout)
    return Node.objects.get(pk=node.pk)


def prove(node: Node, layout: dict[int, list[str]], listable: bool = True) -> None:
    """What node_verify_conclude does with a check's slices (memory as the profile's share of 81920 MiB)."""
    share = {"1g.10gb": 9728, "1g.20gb": 19968, "2g.20gb": 19968, "3g.40gb": 40192, "4g.40gb": 40192,
             "7g.80gb": 80896}
    slices = [{"gpu": gpu, "device": n, "profile": p, "uuid": slice_uuid(node.pk, gpu, n), "memory_mib": share[p],
               "proven": True} for gpu, profiles in layout.items() for n, p in enumerate(profiles)]
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        node_apply_mig_slices(node=locked, slices=slices, listable=listable)
