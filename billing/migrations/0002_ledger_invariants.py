"""The ledger's invariants, held by PostgreSQL itself (other databases rely on billing.services.ledger).

1. Balanced: every INSERT into billing_entry must add entries that sum to zero for each transaction it
   touches (a statement-level trigger over the inserted rows only: a set-based posting of 150,000
   entries is one cheap check, and a single posting does not read the table). So a transaction's entries
   sum to zero after every statement, for good. And at COMMIT, every transaction created in it has at
   least two entries (a deferred constraint trigger): no transaction without entries.
2. Append-only: ledger transactions, entries and usage intervals can be neither updated nor deleted
   (corrections are reversing transactions). TRUNCATE, which only tests use, is not affected.
"""
from django.db import migrations

FORWARD = """
CREATE FUNCTION billing_entries_balanced() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad bigint;
BEGIN
    SELECT transaction_id INTO bad FROM inserted GROUP BY transaction_id HAVING sum(amount_micros) <> 0 LIMIT 1;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'ledger transaction % does not balance: the entries added to it must sum to zero', bad
            USING ERRCODE = 'check_violation', CONSTRAINT = 'billing_entries_balanced';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER billing_entries_balanced
    AFTER INSERT ON billing_entry REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION billing_entries_balanced();

CREATE FUNCTION billing_transaction_has_entries() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT count(*) FROM (SELECT 1 FROM billing_entry WHERE transaction_id = NEW.id LIMIT 2) two) < 2 THEN
        RAISE EXCEPTION 'ledger transaction % needs at least two entries', NEW.id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'billing_transaction_has_entries';
    END IF;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER billing_transaction_has_entries
    AFTER INSERT ON billing_ledgertransaction DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION billing_transaction_has_entries();

CREATE FUNCTION billing_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: post a reversing transaction instead', TG_TABLE_NAME
        USING ERRCODE = 'check_violation', CONSTRAINT = 'billing_append_only';
END $$;

CREATE TRIGGER billing_ledgertransaction_append_only BEFORE UPDATE OR DELETE ON billing_ledgertransaction
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();
CREATE TRIGGER billing_entry_append_only BEFORE UPDATE OR DELETE ON billing_entry
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();
CREATE TRIGGER billing_usageinterval_append_only BEFORE UPDATE OR DELETE ON billing_usageinterval
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS billing_usageinterval_append_only ON billing_usageinterval;
DROP TRIGGER IF EXISTS billing_entry_append_only ON billing_entry;
DROP TRIGGER IF EXISTS billing_ledgertransaction_append_only ON billing_ledgertransaction;
DROP FUNCTION IF EXISTS billing_append_only();
DROP TRIGGER IF EXISTS billing_transaction_has_entries ON billing_ledgertransaction;
DROP FUNCTION IF EXISTS billing_transaction_has_entries();
DROP TRIGGER IF EXISTS billing_entries_balanced ON billing_entry;
DROP FUNCTION IF EXISTS billing_entries_balanced();
"""


def _run(schema_editor, sql):
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(sql)  # no parameters: the % in RAISE messages are PL/pgSQL's, not placeholders


def forwards(apps, schema_editor):
    _run(schema_editor, FORWARD)


def backwards(apps, schema_editor):
    _run(schema_editor, BACKWARD)


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
