"""Review r54 (ops, MEDIUM-1): the compose beat kept its schedule file (/app/var/celerybeat-schedule) in the
container's writable layer, so each deploy (a recreated container) lost it; a beat started without it takes every
crontab as run just now, and one recreated after Monday 03:00 UTC skipped that week's payouts (paid a week late with
the next, the week with no Payout row). Now the file is on a named volume, the health check wants it written lately
(a fresh empty file passed `test -f`), and the payout run is daily: a payout is made once per (provider, week), so a
missed Monday is paid the next day."""
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import yaml
from celery.beat import ScheduleEntry
from django.conf import settings

from billing.services.payouts import payout_period
from config.celery import app

ROOT = Path(__file__).resolve().parent.parent


def test_beat_schedule_file_survives_a_recreated_beat_container():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    beat = compose["services"]["beat"]
    schedule_dir = str(Path(settings.CELERY_BEAT_SCHEDULE_FILENAME).parent.relative_to(settings.VAR_DIR))
    assert schedule_dir == "."  # the file lives in VAR_DIR (/app/var in the image)
    mounts = dict(v.split(":")[::-1] for v in beat.get("volumes", []) if isinstance(v, str))
    assert "/app/var" in mounts, mounts
    assert mounts["/app/var"] in compose["volumes"]  # a named volume, kept across `docker compose up`
    assert mounts.get("/app/var/metrics") == "metrics"  # still shares the metrics directory
    check = " ".join(beat["healthcheck"]["test"])
    assert "test -f" not in check and "-mmin" in check and "celerybeat-schedule" in check


def test_a_fresh_beat_started_after_monday_0300_runs_the_payouts_within_a_day():
    entry = settings.CELERY_BEAT_SCHEDULE["billing-payouts"]
    monday_0400 = datetime(2026, 12, 7, 4, 0, tzinfo=UTC)
    fresh = ScheduleEntry(name="billing-payouts", task=entry["task"], schedule=entry["schedule"], app=app,
                          last_run_at=monday_0400)  # a beat without its file starts with last_run_at = now
    before, entry["schedule"].nowfun = entry["schedule"].nowfun, lambda: monday_0400
    try:
        due, next_s = fresh.schedule.is_due(fresh.last_run_at)
    finally:
        entry["schedule"].nowfun = before
    assert due or next_s <= 24 * 3600, f"next payouts run in {next_s / 86400:.1f} days"


def test_every_days_run_pays_the_same_week_as_mondays():
    monday = date(2026, 12, 7)
    assert {payout_period(monday + timedelta(days=d)) for d in range(7)} == {payout_period(monday)}
