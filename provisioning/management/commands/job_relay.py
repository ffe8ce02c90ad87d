"""`manage.py job_relay`: hand new jobs to the broker as they commit (provisioning/services/relay.py).

Run one or more per deployment (scripts/run-relay); they share the work. SIGTERM or SIGINT ends it after the batch
under way."""
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from provisioning.services.relay import RELAY_BATCH, jobs_relay_run


class Command(BaseCommand):
    help = "Send new jobs to the broker as they commit (LISTEN job_outbox), in batches."

    def add_arguments(self, parser):
        parser.add_argument("--poll", type=float, default=None,
                            help="seconds between looks without a notification (default JOB_RELAY_POLL_S)")
        parser.add_argument("--batch", type=int, default=RELAY_BATCH, help="jobs per batch (%(default)s)")

    def handle(self, *args, poll=None, batch=RELAY_BATCH, **options):
        if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
            raise CommandError("the job relay needs PostgreSQL (LISTEN/NOTIFY); with another database the jobs are "
                               "sent on commit and by the dispatcher")
        if batch < 1:
            raise CommandError("--batch must be at least 1")
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.stdout.write(f"job relay: listening on job_outbox (batch {batch})")
        self.stdout.flush()
        jobs_relay_run(stop=stop, poll_s=poll, limit=batch)
        self.stdout.write("job relay: stopped")
