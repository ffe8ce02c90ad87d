# A node proven without a host key is not proven (found by review).
#
# 0034's backfill marked proven every node the platform had reached (a `host_key_pinned` event, last_seen_at, or
# a listing verdict), a key or not: 0008 had cleared the keys of the later duplicates of one server and kept their
# last_seen_at. Such a node connected with an empty pin, which takes any host key, and was never pinned afterwards
# (only an unproven node was): any server at its address was taken for it, and it held its address
# (node_unique_live_endpoint) on the strength of a proof that pinned nothing. Those nodes are unproven again: their
# next contact pins the key the server shows and proves them (provisioning.services.nodes._pin_host_key, which now
# also pins a proven node with no key), or finds the server listed already (DuplicateHardware).
#
# Safe on existing rows: an unproven node falls out of the conditions of node_unique_live_endpoint and
# node_unique_live_host_key (and a node without a key was never in the latter's), so no constraint can fail.

from django.db import migrations


def unprove_keyless(apps, schema_editor):
    Node = apps.get_model("marketplace", "Node")
    Node.objects.filter(control_proven_at__isnull=False, host_key_fingerprint="").update(control_proven_at=None)


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0034_node_proven_control'),
    ]

    operations = [
        migrations.RunPython(unprove_keyless, migrations.RunPython.noop, elidable=True),
    ]
