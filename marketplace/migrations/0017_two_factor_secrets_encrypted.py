"""Move django-otp's TOTP devices and recovery codes, whose secrets it stores readable, into the project's devices
that keep them encrypted (marketplace/models/two_factor.py), and delete the readable rows. Users keep their
authenticator app, their unused recovery codes and two-factor log-in as they were."""
from binascii import unhexlify

from django.db import migrations

from marketplace.encryption import encrypt_secret


def forwards(apps, schema_editor):
    TOTPDevice = apps.get_model("otp_totp", "TOTPDevice")
    StaticDevice = apps.get_model("otp_static", "StaticDevice")
    AuthenticatorDevice = apps.get_model("marketplace", "AuthenticatorDevice")
    RecoveryCodeDevice = apps.get_model("marketplace", "RecoveryCodeDevice")
    RecoveryCode = apps.get_model("marketplace", "RecoveryCode")
    for old in TOTPDevice.objects.all():
        AuthenticatorDevice.objects.create(
            user_id=old.user_id, name=old.name, confirmed=old.confirmed,
            key_encrypted=encrypt_secret(unhexlify(old.key.encode())), step=old.step, t0=old.t0, digits=old.digits,
            tolerance=old.tolerance, drift=old.drift, last_t=old.last_t,
            throttling_failure_timestamp=old.throttling_failure_timestamp,
            throttling_failure_count=old.throttling_failure_count)
    TOTPDevice.objects.all().delete()
    for old in StaticDevice.objects.all():
        device = RecoveryCodeDevice.objects.create(
            user_id=old.user_id, name=old.name, confirmed=old.confirmed,
            throttling_failure_timestamp=old.throttling_failure_timestamp,
            throttling_failure_count=old.throttling_failure_count)
        RecoveryCode.objects.bulk_create([
            RecoveryCode(device=device, code_encrypted=encrypt_secret(token.token.encode()))
            for token in old.token_set.all()])
    StaticDevice.objects.all().delete()


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0016_two_factor_encrypted_devices"),
        ("otp_totp", "0003_add_timestamps"),
        ("otp_static", "0003_add_timestamps"),
    ]

    # Backwards leaves the encrypted devices where they are (there is no going back to readable secrets).
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
