"""Instance.disk_rate_base_seconds/_cost_micros: the disk meter's rate base, which a give-back of a stopped
instance's disk (billing.services.storage.disk_give_back) moves on by the seconds given back and what they were
charged, so that the disk's later seconds cost what the seconds paid for cost. Give-backs made before it are found
by the renter's event each one wrote in its transaction (interruptions.lost_disk_give_back: kind `credit`, data with
the instance, `disk`, the seconds and `billing_stopped_at`): the base moved on by their seconds, its cost what keeps
disk_cost_micros == base's cost + cost(disk_billed_seconds - base's seconds), as the give-back now sets it. Every
other row: 0 and 0. Plain Python over those events: runs on SQLite too."""

from django.db import migrations, models

SECONDS_PER_MONTH = 30 * 24 * 3600  # marketplace.models.host.SECONDS_PER_MONTH, as billing.services.storage reads it


def disk_rate_base_from_give_backs(apps, schema_editor):
    BillingEvent = apps.get_model("billing", "BillingEvent")
    Instance = apps.get_model("marketplace", "Instance")
    seconds: dict[int, int] = {}
    for data in BillingEvent.objects.filter(kind="credit").values_list("data", flat=True).iterator():
        if not isinstance(data, dict) or data.get("disk") is not True or "billing_stopped_at" not in data:
            continue
        instance, given = data.get("instance"), data.get("seconds")
        if isinstance(instance, int) and isinstance(given, int) and given > 0:
            seconds[instance] = seconds.get(instance, 0) + given
    for pk, given in seconds.items():
        row = (
            Instance.objects.filter(pk=pk)
            .values_list("disk_gb", "disk_price_per_gb_month_micros", "disk_billed_seconds", "disk_cost_micros")
            .first()
        )
        if row is None:
            continue
        size_gb, price, billed, cost = row
        base = min(given, billed)
        Instance.objects.filter(pk=pk).update(
            disk_rate_base_seconds=base,
            disk_rate_base_cost_micros=cost - size_gb * price * (billed - base) // SECONDS_PER_MONTH,
        )


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0019_stripe_events_redacted"),
        ("marketplace", "0040_user_email_changed_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="instance",
            name="disk_rate_base_seconds",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="instance",
            name="disk_rate_base_cost_micros",
            field=models.BigIntegerField(default=0),
        ),
        migrations.RunPython(disk_rate_base_from_give_backs, migrations.RunPython.noop),
    ]
