"""A check's MIG slices are applied with the node's GPU rows locked in id order, as every other lock of several GPU
rows takes them (the admin's node page, a MIG release's share lock). By index, once an inventory had numbered the
cards anew (index order no longer id order), it deadlocked with them (found by review)."""
import threading
import time

import pytest
from django.db import connection, connections, transaction

from marketplace.models import Gpu, Node
from provisioning.services.mig import node_apply_mig_slices
from tests.marketplace.mig_helpers import make_mig_node

pytestmark = pytest.mark.django_db(transaction=True)


def _waits_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row) and row[0] == "Lock"


def test_applying_a_checks_slices_and_an_id_ordered_lock_of_the_same_gpus_both_commit():
    node = make_mig_node({0: ["3g.40gb"], 1: ["3g.40gb"]}, gpu_count=2)
    low, high = Gpu.objects.filter(node=node).order_by("pk")
    # Numbered anew: the card with the higher id is GPU 0 now.
    Gpu.objects.filter(pk=low.pk).update(index=99)
    Gpu.objects.filter(pk=high.pk).update(index=0)
    Gpu.objects.filter(pk=low.pk).update(index=1)
    held_low, applying_pid, errors = threading.Event(), [], []

    def id_ordered():  # as the admin's node page: its GPUs FOR UPDATE in id order, one row at a time
        try:
            with transaction.atomic():
                list(Gpu.objects.select_for_update().filter(pk=low.pk))
                held_low.set()
                for _ in range(200):  # until the check waits on a lock
                    if applying_pid and _waits_on_a_lock(applying_pid[0]):
                        break
                    time.sleep(0.025)
                list(Gpu.objects.select_for_update().filter(pk=high.pk))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(("id-ordered", exc))
        finally:
            connections.close_all()

    def apply():
        try:
            held_low.wait(5)
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    applying_pid.append(cursor.fetchone()[0])
                locked = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
                node_apply_mig_slices(node=locked, slices=[], listable=True)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(("apply", exc))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=id_ordered), threading.Thread(target=apply)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
