"""Refund holds: an operator's refund takes its amount from the wallet when it is asked for (to the new platform
account `refunds_pending`, ledger kind `refund_hold`), so that money reserved for a pending refund cannot be spent
while Stripe's answer is awaited (billing.services.refunds).

No data step: a refund pending before this migration has no hold (`Refund.hold` null) and settles as before (its
confirmation debits the wallet; the reservation check still counts its amount).
"""
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0016_stop_not_before_any_cost_rise'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='refund',
            name='hold',
            field=models.OneToOneField(blank=True, help_text="The amount taken from the wallet when the operator asked for the refund (to the refunds-pending account), so that it cannot be spent while Stripe's answer is awaited. None for a refund made at Stripe and for one reserved before holds were posted (migration 0017): those are debited when Stripe has them.", null=True, on_delete=django.db.models.deletion.PROTECT, related_name='refund_held', to='billing.ledgertransaction'),
        ),
        migrations.AlterField(
            model_name='account',
            name='kind',
            field=models.CharField(choices=[('customer_wallet', 'Customer wallet'), ('provider_earnings', 'Provider earnings'), ('platform_revenue', 'Platform revenue (fees)'), ('payment_clearing', 'Payment clearing (Stripe)'), ('payout_clearing', 'Payout clearing (Stripe Connect)'), ('promotions', 'Promotions and manual credits'), ('refunds_pending', 'Refunds pending (held for a refund to the card)')], max_length=20),
        ),
        migrations.AlterField(
            model_name='ledgertransaction',
            name='kind',
            field=models.CharField(choices=[('usage', 'Usage'), ('storage', "Storage (volumes, stopped instances' disks)"), ('top_up', 'Top-up'), ('refund', 'Refund'), ('refund_hold', 'Refund (held until the card is refunded)'), ('credit', 'Manual credit'), ('debit', 'Manual debit'), ('payout', 'Payout'), ('payout_reversal', 'Payout returned'), ('reversal', 'Reversal'), ('service_credit', 'Service credit (interruption, charged to the provider)'), ('chargeback', 'Chargeback (a card payment disputed at the bank)')], max_length=20),
        ),
        migrations.AddConstraint(
            model_name='refund',
            constraint=models.CheckConstraint(condition=models.Q(('hold__isnull', True), ('origin', 'platform'), _connector='OR'), name='refund_hold_platform_only'),
        ),
    ]
