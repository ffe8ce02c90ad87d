"""Reads that encode marketplace rules."""
from django.db.models import Count, ExpressionWrapper, F, FloatField, OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce

from marketplace.models import Gpu, GpuStatus, Node, NodeState, User
from marketplace.models.nodes import LISTABLE_VERDICTS


def _free_gpu_count():
    free = (
        Gpu.objects.filter(node=OuterRef("pk"), status=GpuStatus.FREE)
        .order_by()
        .values("node")
        .annotate(n=Count("*"))
        .values("n")
    )
    return Coalesce(Subquery(free), Value(0))


def offers_search() -> QuerySet[Node]:
    """Every node a renter can book now: active, verified or degraded, listed, with free GPUs.

    Annotates `num_gpus_free` and `score_per_dollar` (score per USD per GPU-hour) so
    that filters and ordering run in SQL.
    """
    return (
        Node.objects.filter(state=NodeState.ACTIVE, verdict__in=LISTABLE_VERDICTS, listed=True)
        .annotate(
            num_gpus_free=_free_gpu_count(),
            score_per_dollar=ExpressionWrapper(
                F("score") * 1_000_000.0 / F("price_per_gpu_hour_micros"), output_field=FloatField()
            ),
        )
        .filter(num_gpus_free__gt=0)
        .select_related("gpu_model")
    )


def nodes_for_user(*, user: User) -> QuerySet[Node]:
    """A provider's own live nodes; operators see every live node."""
    nodes = Node.objects.exclude(state=NodeState.RETIRED).select_related("gpu_model")
    if not user.is_staff:
        nodes = nodes.filter(provider=user)
    return nodes.prefetch_related("gpus")
