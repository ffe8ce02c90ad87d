"""Instance.given_back_seconds: of its billed seconds, those given back (billing.services.metering.usage_give_back),
so that pages and the API show the seconds paid for. Give-backs made before it are counted from the renter's event
each one wrote in its transaction (interruptions.lost_usage_give_back: kind `credit`, data with the instance, the
seconds and `billing_stopped_at`; a disk's says `disk`). Plain Python over those events: runs on SQLite too."""

from django.db import migrations, models


def given_back_seconds_from_events(apps, schema_editor):
    BillingEvent = apps.get_model("billing", "BillingEvent")
    Instance = apps.get_model("marketplace", "Instance")
    seconds: dict[int, int] = {}
    for data in BillingEvent.objects.filter(kind="credit").values_list("data", flat=True).iterator():
        if not isinstance(data, dict) or data.get("disk") or "billing_stopped_at" not in data:
            continue
        instance, given = data.get("instance"), data.get("seconds")
        if isinstance(instance, int) and isinstance(given, int) and given > 0:
            seconds[instance] = seconds.get(instance, 0) + given
    for pk, given in seconds.items():
        Instance.objects.filter(pk=pk).update(given_back_seconds=given)


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0019_stripe_events_redacted"),
        ("marketplace", "0037_instance_require_nvlink"),
    ]

    operations = [
        migrations.AddField(
            model_name="instance",
            name="given_back_seconds",
            field=models.BigIntegerField(default=0),
        ),
        migrations.RunPython(given_back_seconds_from_events, migrations.RunPython.noop),
    ]
