"""Accounts get their canonical address (core.email_address.email_canonical), unique in the database.

Existing accounts are backfilled in order of id. Two accounts whose addresses reach one mailbox (look-alike
spellings the old case-insensitive check let through, e.g. 'bücher.de' and 'xn--bcher-kva.de', or a full-width
letter) cannot both keep it: the older account (lower id) keeps the canonical address; each younger one gets a
marker without an '@' ('user-<id>:shares-mailbox-with-user-<id>'), which no address matches, so it can no longer
be found by its address (log-in, reset, sign-up) until an operator gives it an address of its own in the admin (its
marker is replaced on that save). An address that cannot be encoded for delivery gets 'user-<id>:undeliverable'.
Both are printed, and none is deleted or changed otherwise. Works on PostgreSQL and SQLite.
"""
from django.db import migrations, models

from core.email_address import CANONICAL_MAX_LENGTH, email_canonical
from core.errors import ValidationFailed


def backfill(apps, schema_editor):
    User = apps.get_model("marketplace", "User")
    db = schema_editor.connection.alias
    owner: dict[str, int] = {}
    for pk, email in User.objects.using(db).order_by("pk").values_list("pk", "email").iterator():
        try:
            canonical = email_canonical(email)
        except ValidationFailed:
            canonical = f"user-{pk}:undeliverable"
            print(f"\n  account {pk} ({email!r}): its address cannot receive e-mail; marked {canonical!r}")
        else:
            if canonical in owner:
                keeper = owner[canonical]
                print(f"\n  account {pk} ({email!r}) reaches the mailbox of account {keeper}, which keeps it; give it "
                      "an address of its own in the admin")
                canonical = f"user-{pk}:shares-mailbox-with-user-{keeper}"
            else:
                owner[canonical] = pk
        User.objects.using(db).filter(pk=pk).update(email_canonical=canonical)


class Migration(migrations.Migration):

    dependencies = [
        ("marketplace", "0041_instance_disk_rate_base"),
    ]

    operations = [
        migrations.AddField(
            model_name="user",
            name="email_canonical",
            field=models.CharField(editable=False, max_length=CANONICAL_MAX_LENGTH, null=True),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="user",
            name="email_canonical",
            field=models.CharField(
                editable=False, max_length=CANONICAL_MAX_LENGTH, unique=True,
                help_text="The mailbox the address reaches (core.email_address.email_canonical): accounts are looked "
                          "up and kept unique by it. Set from the address on every save that changes it."),
        ),
    ]
