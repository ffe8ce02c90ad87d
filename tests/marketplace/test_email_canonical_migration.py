"""Migration 0042 gives every account its canonical address (core.email_address), unique: accounts whose addresses
reach one mailbox keep their rows, the oldest keeps the address, each younger one gets a marker no address matches
(until an operator gives it an address of its own); an address no e-mail can reach is marked too. The database is
taken back to 0041 and forward again (to the latest migrations: the tests after this one need every column)."""
import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from marketplace.models import User
from tests import migration_steps

BEFORE = [("marketplace", "0041_instance_disk_rate_base")]


@pytest.mark.django_db(transaction=True)
def test_existing_accounts_get_their_canonical_address_and_lookalike_duplicates_are_kept_but_marked():
    executor = MigrationExecutor(connection)
    try:
        migration_steps.migrate(executor, BEFORE)
        old_user = executor.loader.project_state(BEFORE).apps.get_model("marketplace", "User")
        spellings = ["bob@b\u00fccher.de", "alice@stripe.com", "bob@xn--bcher-kva.de", "alice@\uff53tripe.com",
                     "alice@g\u0131thub.com", "carol@" + "\u00e4" * 60 + ".de"]
        pks = [old_user.objects.create(email=e, password="!").pk for e in spellings]
    finally:
        migration_steps.migrate(MigrationExecutor(connection))  # to the latest migrations (tests/migration_steps.py)
    got = dict(User.objects.filter(pk__in=pks).values_list("pk", "email_canonical"))
    assert [got[pk] for pk in pks] == [
        "bob@xn--bcher-kva.de", "alice@stripe.com", f"user-{pks[2]}:shares-mailbox-with-user-{pks[0]}",
        f"user-{pks[3]}:shares-mailbox-with-user-{pks[1]}", "alice@xn--gthub-n4a.com", f"user-{pks[5]}:undeliverable"]
    # A marked account is given an address of its own: its marker is replaced.
    marked = User.objects.get(pk=pks[3])
    marked.first_name = "kept"
    marked.save()
    assert User.objects.get(pk=pks[3]).email_canonical.startswith("user-")
    marked.email = "alice2@stripe.com"
    marked.save(update_fields=["email"])
    assert User.objects.get(pk=pks[3]).email_canonical == "alice2@stripe.com"
