"""Every refund by one rule, disputes kept with their top-up, a top-up's charge id.

Refunds made in Stripe's dashboard become Refund rows (origin `stripe`, no operator); disputes get a row (Dispute)
naming the top-up and the debit (and its reversal, when won), so that what a dispute holds is not refundable; a
top-up records the charge that paid it (a dispute naming only its charge is matched by it).

The data step keeps what was posted before: each `dispute:<id>` debit becomes a Dispute of the top-up its memo names
(with its `dispute-won:<id>` reversal), and each dashboard refund debited by the charge's refunded total
(`charge-refunded:<top-up>:<cents>`) a Refund of origin `stripe` without a Stripe id (that total named none): the first
Stripe event naming a refund of that top-up and amount gives it its id (billing.services.refunds._made_at_stripe).
"""
import re

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


DISPUTE_MEMO = re.compile(r"Dispute (\S+) of top-up (\d+) ")
LEGACY_REFUND_KEY = re.compile(r"charge-refunded:(\d+):(\d+)")
BANK_REASON = re.compile(r"reason: (.*)\)\.$")


def _wallet_debit(Entry, txn) -> int:
    return -sum(Entry.objects.filter(transaction=txn, account__kind="customer_wallet")
                .values_list("amount_micros", flat=True))


def forwards(apps, schema_editor):
    LedgerTransaction = apps.get_model("billing", "LedgerTransaction")
    Entry = apps.get_model("billing", "Entry")
    TopUp = apps.get_model("billing", "TopUp")
    Dispute = apps.get_model("billing", "Dispute")
    Refund = apps.get_model("billing", "Refund")
    for txn in LedgerTransaction.objects.filter(kind="chargeback", idempotency_key__startswith="dispute:"):
        match = DISPUTE_MEMO.match(txn.memo)
        amount = _wallet_debit(Entry, txn)
        if not match or amount <= 0 or not TopUp.objects.filter(pk=int(match[2])).exists():
            continue
        dispute_id = txn.idempotency_key.removeprefix("dispute:")
        reason = BANK_REASON.search(txn.reason)
        Dispute.objects.get_or_create(stripe_dispute_id=dispute_id, defaults={
            "top_up_id": int(match[2]), "amount_micros": amount, "debit": txn, "created_at": txn.created_at,
            "bank_reason": reason[1][:60] if reason else "",
            "reversal": LedgerTransaction.objects.filter(idempotency_key=f"dispute-won:{dispute_id}").first()})
    for txn in LedgerTransaction.objects.filter(kind="refund", idempotency_key__startswith="charge-refunded:"):
        match = LEGACY_REFUND_KEY.fullmatch(txn.idempotency_key)
        amount = _wallet_debit(Entry, txn)
        if not match or amount <= 0 or not TopUp.objects.filter(pk=int(match[1])).exists():
            continue
        Refund.objects.get_or_create(transaction=txn, defaults={
            "top_up_id": int(match[1]), "amount_micros": amount, "status": "succeeded", "origin": "stripe",
            "reason": txn.reason or "Refunded at Stripe (its dashboard), not through the platform.",
            "customer_note": txn.customer_note, "created_at": txn.created_at})


def backwards(apps, schema_editor):
    # Before 0013 refunds had an operator and disputes no rows: those are what this migration's code made.
    apps.get_model("billing", "Refund").objects.filter(origin="stripe").delete()
    apps.get_model("billing", "Dispute").objects.all().delete()


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0012_chargebacks'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='Dispute',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('stripe_dispute_id', models.CharField(max_length=100, unique=True)),
                ('amount_micros', models.BigIntegerField()),
                ('bank_reason', models.CharField(blank=True, help_text="The reason the bank gave (Stripe's).", max_length=60)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
            options={
                'ordering': ['-created_at', '-id'],
            },
        ),
        migrations.RemoveConstraint(
            model_name='refund',
            name='refund_succeeded_is_posted',
        ),
        migrations.AddField(
            model_name='refund',
            name='origin',
            field=models.CharField(choices=[('platform', 'An operator, through the platform'), ('stripe', 'Made at Stripe (its dashboard), not through the platform')], default='platform', max_length=10),
        ),
        migrations.AddField(
            model_name='topup',
            name='charge_id',
            field=models.CharField(blank=True, max_length=100, null=True, unique=True),
        ),
        migrations.AlterField(
            model_name='refund',
            name='created_by',
            field=models.ForeignKey(blank=True, help_text='The operator; none for a refund made at Stripe.', null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddConstraint(
            model_name='refund',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('status', 'succeeded'), _negated=True), models.Q(('stripe_refund_id__isnull', False), ('transaction__isnull', False)), models.Q(('origin', 'stripe'), ('transaction__isnull', False)), _connector='OR'), name='refund_succeeded_is_posted'),
        ),
        migrations.AddConstraint(
            model_name='refund',
            constraint=models.CheckConstraint(condition=models.Q(('origin', 'stripe'), ('created_by__isnull', False), _connector='OR'), name='refund_platform_has_operator'),
        ),
        migrations.AddField(
            model_name='dispute',
            name='debit',
            field=models.OneToOneField(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='dispute', to='billing.ledgertransaction'),
        ),
        migrations.AddField(
            model_name='dispute',
            name='reversal',
            field=models.OneToOneField(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='dispute_given_back', to='billing.ledgertransaction'),
        ),
        migrations.AddField(
            model_name='dispute',
            name='top_up',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='disputes', to='billing.topup'),
        ),
        migrations.AddConstraint(
            model_name='dispute',
            constraint=models.CheckConstraint(condition=models.Q(('amount_micros__gt', 0)), name='dispute_amount_positive'),
        ),
        migrations.AddConstraint(
            model_name='dispute',
            constraint=models.CheckConstraint(condition=models.Q(('reversal__isnull', True), ('debit__isnull', False), _connector='OR'), name='dispute_given_back_was_debited'),
        ),
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
