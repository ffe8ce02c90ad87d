# One server, one live node: a host key, and a GPU UUID, on at most one live (not retired) node.
#
# Existing rows are made to fit first. Retired nodes let go of their GPU UUIDs (the services do so from now on,
# see node_retire). Where live nodes already share a host key or a GPU, the one that keeps it is the first
# listed (verified or degraded) node, else the oldest; each other one is rejected as a duplicate: the shared
# values are cleared (nothing pinned, no GPU claimed), verdict and state `rejected` (the state stays while
# renters use it: its verdict keeps it off the offers, as for any rejection), with a reason for its provider
# that names no other node. Its provider may verify it again once the first node is retired.

from django.db import migrations, models
from django.db.models import Count
from django.utils import timezone

LISTABLE = ("verified", "degraded")
# The findings duplicate_host_key / duplicate_gpu in short (provisioning.verification.policy; a migration imports no
# app code).
DUPLICATE_REASON = (
    "Rejected: this server (its SSH host key or a GPU) belongs to another live node: a server can be listed only "
    "once. If you registered it before, use that node or retire it, then verify this one again."
)


def _keeper_first(nodes):
    return sorted(nodes, key=lambda n: (n.verdict not in LISTABLE, n.pk))


def _reject_duplicate(Node, Gpu, node):
    node.verdict = "rejected"
    node.last_error = DUPLICATE_REASON
    rented = Gpu.objects.filter(node=node, status="rented").exists()
    if node.state not in ("retired", "quarantined", "rejected") and not rented:
        node.state = "rejected"
        node.state_changed_at = timezone.now()
    node.save(update_fields=["host_key_fingerprint", "verdict", "last_error", "state", "state_changed_at"])
    Gpu.objects.filter(node=node).exclude(uuid="").update(uuid="")


def resolve_duplicates(apps, schema_editor):
    Node = apps.get_model("marketplace", "Node")
    Gpu = apps.get_model("marketplace", "Gpu")
    Gpu.objects.filter(node__state="retired").exclude(uuid="").update(uuid="")
    live = Node.objects.exclude(state="retired")

    shared_keys = (live.exclude(host_key_fingerprint="").values("host_key_fingerprint")
                   .annotate(n=Count("id")).filter(n__gt=1).values_list("host_key_fingerprint", flat=True))
    for fingerprint in list(shared_keys):
        for node in _keeper_first(live.filter(host_key_fingerprint=fingerprint))[1:]:
            node.host_key_fingerprint = ""
            _reject_duplicate(Node, Gpu, node)

    shared_uuids = (Gpu.objects.exclude(uuid="").values("uuid").annotate(n=Count("id")).filter(n__gt=1)
                    .values_list("uuid", flat=True))
    for uuid in list(shared_uuids):
        holders = _keeper_first(Node.objects.filter(gpus__uuid=uuid).distinct())
        if not holders:
            continue
        for node in holders[1:]:
            _reject_duplicate(Node, Gpu, node)
        # The same UUID twice on the keeper's own GPUs: none of them keeps it (its next verification says why).
        if Gpu.objects.filter(node=holders[0], uuid=uuid).count() > 1:
            Gpu.objects.filter(node=holders[0], uuid=uuid).update(uuid="")


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0007_node_benchmark_summary'),
    ]

    operations = [
        migrations.RunPython(resolve_duplicates, migrations.RunPython.noop, elidable=True),
        migrations.AddConstraint(
            model_name='node',
            constraint=models.UniqueConstraint(condition=models.Q(models.Q(('state', 'retired'), _negated=True), models.Q(('host_key_fingerprint', ''), _negated=True)), fields=('host_key_fingerprint',), name='node_unique_live_host_key', violation_error_message='Another live node already has this SSH host key.'),
        ),
        migrations.AddConstraint(
            model_name='gpu',
            constraint=models.UniqueConstraint(condition=models.Q(('uuid', ''), _negated=True), fields=('uuid',), name='gpu_unique_uuid', violation_error_message='Another live node already has a GPU with this UUID.'),
        ),
    ]
