# The grace period at zero balance destroys only what a warning named, at the time it named
# (billing.services.enforcement._grace): each thing's time is kept in BillingProfile.destroy_deadlines. A renter
# already warned when this runs keeps the warning they got: the things their last destroy warning of this zero
# balance named, at its time, are copied from that event's data (what it named is what it stored). Backwards: nothing
# to undo (the field goes).
from django.db import migrations, models


def named_by_last_warning(apps, schema_editor):
    BillingProfile = apps.get_model("billing", "BillingProfile")
    BillingEvent = apps.get_model("billing", "BillingEvent")
    db = schema_editor.connection.alias
    for profile in BillingProfile.objects.using(db).exclude(depleted_at=None).exclude(destroy_warned_at=None):
        event = (BillingEvent.objects.using(db).filter(user_id=profile.user_id, kind="destroy_warning",
                                                       created_at__gte=profile.depleted_at)
                 .order_by("-created_at", "-id").first())
        data = event.data if event is not None and isinstance(event.data, dict) else {}
        at = data.get("destroy_at")
        if not isinstance(at, str):
            continue
        record = {f"instance:{pk}": {"at": at, "warned": True} for pk in data.get("instances") or []}
        record |= {f"volume:{pk}": {"at": at, "warned": True} for pk in data.get("volumes") or []}
        BillingProfile.objects.using(db).filter(pk=profile.pk).update(destroy_deadlines=record)


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0019_stripe_events_redacted'),
    ]

    operations = [
        migrations.AddField(
            model_name='billingprofile',
            name='destroy_deadlines',
            field=models.JSONField(blank=True, default=dict, help_text='What the grace period at zero balance destroys, and when: {"instance:<id>" or "volume:<id>": {"at": ISO time, "warned": bool}}. A thing is destroyed only once a warning named it with its time and that time passed (billing.services.enforcement). Cleared with depleted_at.'),
        ),
        migrations.AlterField(
            model_name='billingevent',
            name='kind',
            field=models.CharField(choices=[('low_balance', 'Low balance'), ('balance_depleted', 'Balance depleted: instances stopped'), ('destroy_warning', 'Stopped or failed instances and volumes will be destroyed'), ('instances_destroyed', 'Stopped or failed instances or volumes destroyed'), ('top_up_succeeded', 'Top-up credited'), ('top_up_failed', 'Top-up failed'), ('refund', 'Refund'), ('chargeback', 'Card payment disputed: debited'), ('chargeback_reversed', 'Dispute won: amount back'), ('credit', 'Credit'), ('credit_reversed', 'Credit reversed'), ('payout_paid', 'Payout sent'), ('payout_failed', 'Payout failed'), ('instance_interrupted', 'Instance interrupted'), ('instance_resumed', 'Instance resumed'), ('instance_lost', 'Instance lost with its node'), ('service_credit', 'Service credit'), ('price_cut', 'Price cut: hardware measured worse'), ('price_raised_back', 'Price raised back: hardware measured better again')], max_length=24),
        ),
        migrations.AlterField(
            model_name='billingprofile',
            name='destroy_warned_at',
            field=models.DateTimeField(blank=True, help_text='When the first destroy warning of this zero balance went out.', null=True),
        ),
        migrations.RunPython(named_by_last_warning, migrations.RunPython.noop),
    ]
