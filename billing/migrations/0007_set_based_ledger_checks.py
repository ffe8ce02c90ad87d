"""The ledger's references and its "at least two entries" rule, checked once per statement instead of per row.

A metering tick inserts 50,000 transactions, 150,000 entries and 50,000 intervals: as foreign keys and a
per-row constraint trigger that was 450,000 deferred row checks at COMMIT, each a query of its own. The same
rules, held by PostgreSQL (other databases rely on the services, as for migration 0002):

1. References: every inserted entry names an existing ledger transaction and account, every inserted interval
   an existing instance and (when it has one) ledger transaction, checked by one query per statement over the
   inserted rows (transition tables). Accounts and instances are locked FOR KEY SHARE as a foreign key locks
   them, so none can be deleted before the inserting transaction ends; ledger transactions are append-only
   (migration 0002) and cannot be deleted at all. Deleting, or changing the id of, an account with entries or an
   instance with intervals is refused (what the foreign keys' NO ACTION did).
2. At least two entries per transaction, at COMMIT: each INSERT into billing_ledgertransaction records the ids
   it inserted as one row of billing_ledger_pending; a deferred constraint trigger on that row checks them all
   in one query at COMMIT and deletes the row. One deferred check per statement, not per transaction.
"""

import django.db.models.deletion
from django.db import migrations, models



FORWARD = """
DROP TRIGGER billing_transaction_has_entries ON billing_ledgertransaction;
DROP FUNCTION billing_transaction_has_entries();

CREATE OR REPLACE FUNCTION billing_entries_balanced() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad bigint;
    wanted bigint;  -- not "found": that would hide PL/pgSQL's FOUND
    locked bigint;
BEGIN
    SELECT transaction_id INTO bad FROM inserted GROUP BY transaction_id HAVING sum(amount_micros) <> 0 LIMIT 1;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'ledger transaction % does not balance: the entries added to it must sum to zero', bad
            USING ERRCODE = 'check_violation', CONSTRAINT = 'billing_entries_balanced';
    END IF;
    SELECT i.transaction_id INTO bad FROM (SELECT DISTINCT transaction_id FROM inserted) i
    WHERE NOT EXISTS (SELECT 1 FROM billing_ledgertransaction t WHERE t.id = i.transaction_id) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'billing_entry: ledger transaction % does not exist', bad
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'billing_entry_transaction_exists';
    END IF;
    SELECT count(DISTINCT account_id) INTO wanted FROM inserted;
    SELECT count(*) INTO locked FROM (
        SELECT a.id FROM billing_account a WHERE a.id IN (SELECT account_id FROM inserted) FOR KEY SHARE
    ) ids;
    IF locked <> wanted THEN
        RAISE EXCEPTION 'billing_entry: an account does not exist'
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'billing_entry_account_exists';
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION billing_intervals_reference() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad bigint;
    wanted bigint;  -- not "found": that would hide PL/pgSQL's FOUND
    locked bigint;
BEGIN
    SELECT i.transaction_id INTO bad FROM (SELECT DISTINCT transaction_id FROM inserted
                                           WHERE transaction_id IS NOT NULL) i
    WHERE NOT EXISTS (SELECT 1 FROM billing_ledgertransaction t WHERE t.id = i.transaction_id) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'billing_usageinterval: ledger transaction % does not exist', bad
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'billing_usageinterval_transaction_exists';
    END IF;
    SELECT count(DISTINCT instance_id) INTO wanted FROM inserted;
    SELECT count(*) INTO locked FROM (
        SELECT i.id FROM marketplace_instance i WHERE i.id IN (SELECT instance_id FROM inserted) FOR KEY SHARE
    ) ids;
    IF locked <> wanted THEN
        RAISE EXCEPTION 'billing_usageinterval: an instance does not exist'
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'billing_usageinterval_instance_exists';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER billing_usageinterval_references
    AFTER INSERT ON billing_usageinterval REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION billing_intervals_reference();

CREATE FUNCTION billing_still_referenced() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.id = OLD.id THEN
        RETURN NEW;
    END IF;
    IF (TG_TABLE_NAME = 'billing_account' AND EXISTS (SELECT 1 FROM billing_entry WHERE account_id = OLD.id))
       OR (TG_TABLE_NAME = 'marketplace_instance'
           AND EXISTS (SELECT 1 FROM billing_usageinterval WHERE instance_id = OLD.id)) THEN
        RAISE EXCEPTION '% % is referenced by the ledger', TG_TABLE_NAME, OLD.id
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'billing_still_referenced';
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;

CREATE TRIGGER billing_account_still_referenced BEFORE DELETE OR UPDATE OF id ON billing_account
    FOR EACH ROW EXECUTE FUNCTION billing_still_referenced();
CREATE TRIGGER billing_instance_still_referenced BEFORE DELETE OR UPDATE OF id ON marketplace_instance
    FOR EACH ROW EXECUTE FUNCTION billing_still_referenced();

CREATE TABLE billing_ledger_pending (id bigserial PRIMARY KEY, transaction_ids bigint[] NOT NULL);

CREATE FUNCTION billing_transactions_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO billing_ledger_pending (transaction_ids)
    SELECT array_agg(id) FROM inserted HAVING count(*) > 0;
    RETURN NULL;
END $$;

CREATE TRIGGER billing_transactions_pending
    AFTER INSERT ON billing_ledgertransaction REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION billing_transactions_pending();

CREATE FUNCTION billing_transactions_have_entries() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad bigint;
BEGIN
    -- One index probe per id (= ANY of a 10,000-id array would be planned as a scan of every entry).
    SELECT t.id INTO bad FROM unnest(NEW.transaction_ids) t(id)
    WHERE (SELECT count(*) FROM (SELECT 1 FROM billing_entry e WHERE e.transaction_id = t.id LIMIT 2) two) < 2
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger transaction % needs at least two entries', bad
            USING ERRCODE = 'check_violation', CONSTRAINT = 'billing_transaction_has_entries';
    END IF;
    DELETE FROM billing_ledger_pending WHERE id = NEW.id;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER billing_transaction_has_entries
    AFTER INSERT ON billing_ledger_pending DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION billing_transactions_have_entries();
"""

# Back to migration 0002's functions and triggers (the foreign keys come back as the AlterFields are reversed).
BACKWARD = """
DROP TRIGGER IF EXISTS billing_transaction_has_entries ON billing_ledger_pending;
DROP FUNCTION IF EXISTS billing_transactions_have_entries();
DROP TRIGGER IF EXISTS billing_transactions_pending ON billing_ledgertransaction;
DROP FUNCTION IF EXISTS billing_transactions_pending();
DROP TABLE IF EXISTS billing_ledger_pending;
DROP TRIGGER IF EXISTS billing_instance_still_referenced ON marketplace_instance;
DROP TRIGGER IF EXISTS billing_account_still_referenced ON billing_account;
DROP FUNCTION IF EXISTS billing_still_referenced();
DROP TRIGGER IF EXISTS billing_usageinterval_references ON billing_usageinterval;
DROP FUNCTION IF EXISTS billing_intervals_reference();

CREATE OR REPLACE FUNCTION billing_entries_balanced() RETURNS trigger LANGUAGE plpgsql AS $$
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

    dependencies = [
        ('billing', '0006_storage_transactions'),
        ('marketplace', '0015_volumes_and_host_facts'),
    ]

    operations = [
        migrations.AlterField(
            model_name='entry',
            name='account',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='entries', to='billing.account'),
        ),
        migrations.AlterField(
            model_name='entry',
            name='transaction',
            field=models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.PROTECT, related_name='entries', to='billing.ledgertransaction'),
        ),
        migrations.AlterField(
            model_name='usageinterval',
            name='instance',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='usage_intervals', to='marketplace.instance'),
        ),
        migrations.AlterField(
            model_name='usageinterval',
            name='transaction',
            field=models.OneToOneField(blank=True, db_constraint=False, help_text='None when the amount rounds to zero.', null=True, on_delete=django.db.models.deletion.PROTECT, related_name='usage_interval', to='billing.ledgertransaction'),
        ),
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
