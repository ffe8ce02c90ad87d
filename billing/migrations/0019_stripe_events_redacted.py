# Written by hand: data only.
# Stripe events stored before webhook_receive redacted them still held their secrets (a PaymentIntent's
# client_secret, which confirms the payment from a browser): the event page shows them redacted, but the stored rows
# kept them (found by review: a list lookup read one back, core/admin_site.py refuses those now). Each stored payload
# goes through the same redaction webhook_receive applies (billing.services.webhooks.redact_secrets: every value of a
# key `secret` or `*_secret`, wherever it is in the body, and a body without data or object as it is); what
# processing an event again reads is kept. Only the rows whose text names such a key are read, in batches by id; a
# row the redaction leaves as it is is not written. Backwards: nothing (the secrets are gone, and nothing needs them).
from django.db import migrations, models
from django.db.models.functions import Cast

from billing.services.webhooks import redact_secrets

BATCH = 500


def redact_stored_events(apps, schema_editor):
    StripeEvent = apps.get_model("billing", "StripeEvent")
    # A key ending in "secret" is followed by its closing quote in the JSON text (a superset: values too).
    candidates = (StripeEvent.objects.using(schema_editor.connection.alias)
                  .annotate(text=Cast("payload", models.TextField())).filter(text__contains='secret"')
                  .only("id", "payload").order_by("id"))
    last = 0
    while True:
        rows = list(candidates.filter(id__gt=last)[:BATCH])
        if not rows:
            return
        last = rows[-1].id
        changed = []
        for row in rows:
            redacted = redact_secrets(row.payload)
            if redacted != row.payload:
                row.payload = redacted
                changed.append(row)
        StripeEvent.objects.using(schema_editor.connection.alias).bulk_update(changed, ["payload"])


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0018_follow_up_least_recently_tried_first'),
    ]

    operations = [
        migrations.RunPython(redact_stored_events, migrations.RunPython.noop, elidable=True),
    ]
