"""Settings shared by every environment, read from environment variables.

Embedded defaults make a first run need nothing but Python: SQLite and Celery's
filesystem transport. Production (config.settings.production) refuses those
defaults where they would be unsafe.
"""
from decimal import Decimal
from pathlib import Path
from typing import Any

import dj_database_url
from celery.schedules import crontab

from .cache import cache_url, caches
from .csp import content_security_policy
from .env import env_bool, env_decimal, env_int, env_list, env_networks, env_str

BASE_DIR = Path(__file__).resolve().parent.parent.parent
VAR_DIR = Path(env_str("VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)  # SQLite, the demo broker and beat keep files here

# Embedded development defaults. production.py refuses to start with either.
DEFAULT_SECRET_KEY = "dev-insecure-secret-key-change-me-0123456789abcdefghijklmnopqrstuvwxyz"  # noqa: S105
DEFAULT_FIELD_ENCRYPTION_KEY = "ZGV2LW9ubHktZmllbGQta2V5LWNoYW5nZS1tZS1ub3c="

SECRET_KEY = env_str("SECRET_KEY", DEFAULT_SECRET_KEY)
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# Fernet keys for secrets at rest (node SSH keys, ...). The first one encrypts;
# all of them decrypt, so keys can be rotated by prepending a new one.
FIELD_ENCRYPTION_KEYS = env_list("FIELD_ENCRYPTION_KEYS", [DEFAULT_FIELD_ENCRYPTION_KEY])

INSTALLED_APPS = [
    "core.admin_site.AdminConfig",  # django.contrib.admin with the project's site (core/admin_site.py)
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_countries",
    "django_otp",  # optional two-factor log-in (marketplace/services/two_factor.py)
    # django-otp's own devices keep their secrets readable: their rows were moved into the project's encrypted
    # devices (marketplace migration 0017), and the apps stay installed only for that migration to read them.
    "django_otp.plugins.otp_totp",
    "django_otp.plugins.otp_static",
    "marketplace",
    "provisioning",
    "billing",
    "notifications",  # in-app notices, e-mails and signed webhooks of the apps' events
    "operations",  # the admin's front page and the demo seed: reads every app above
]

MIDDLEWARE = [
    "config.middleware.HealthCheckMiddleware",  # /healthz answers whatever the Host (probes use the IP address)
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",  # CONTENT_SECURITY_POLICY below
    # Before anything reads the URL or the session: control characters are a 400, over-long URLs a 414.
    "core.request_guard.RequestGuardMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# URLs (path and query string, as sent) longer than this are a 414 from core/request_guard.py, JSON under /api/.
# It stays below gunicorn's --limit-request-line (scripts/run-web: 8190, its maximum), over which gunicorn
# answers with its own page.
REQUEST_URL_MAX_CHARS = env_int("REQUEST_URL_MAX_CHARS", 4096)

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "marketplace.web.nav.navigation",  # `nav`: the links by role (marketplace/web/nav.py)
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    # No JIT: PostgreSQL compiles a query once its estimated cost passes jit_above_cost (100,000), and the offers
    # query (its OR of two EXISTS, free GPUs or free MIG slices, is estimated at ~127,000) then spent ~25 ms
    # compiling for a 9-15 ms run, on every request. Nothing this application runs is long enough to win it back.
    # DATABASE_SESSION_OPTIONS= (empty) sends none: PgBouncer refuses the `options` startup parameter unless it is in
    # its ignore_startup_parameters; then set jit = off on the server (ALTER DATABASE ... SET jit = off).
    _session_options = env_str("DATABASE_SESSION_OPTIONS", "-c jit=off")
    if _session_options:
        _options = DATABASES["default"].setdefault("OPTIONS", {})
        _options["options"] = f"{_options.get('options', '')} {_session_options}".strip()
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # The embedded default is shared by web, worker and beat processes: wait for locks instead of
    # failing, take the write lock at BEGIN (no upgrade deadlocks), and let readers run beside a writer.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# The hot paths' fixed statements (core/sql.py: a booking's) are prepared once per connection on PostgreSQL. Turn it
# off behind a transaction-pooling PgBouncer older than 1.21, which cannot keep prepared statements.
DATABASE_PREPARED_STATEMENTS = env_bool("DATABASE_PREPARED_STATEMENTS", True)

# A shared cache is needed for throttling and log-in lock-outs across processes: CACHE_URL, or with a Redis
# broker the same Redis server's next database (config/settings/cache.py). Local memory (neither) is only right
# for a single-process first run.
CACHE_URL = cache_url(cache_url=env_str("CACHE_URL", ""), broker_url=env_str("CELERY_BROKER_URL", ""))
CACHES = caches(CACHE_URL)

# The client's address (core/client_address.py): REMOTE_ADDR, unless the request comes from one of these proxies
# (IPs or CIDRs); then X-Forwarded-For, read from the right past the trusted proxies. None by default: a header
# anyone can send never picks the address that throttles count by.
TRUSTED_PROXIES = env_networks("TRUSTED_PROXIES", [])

# Log-ins (API, web pages, admin) go through one backend that locks out password guessing (core/login_throttle.py):
# after this many failures within the window for one email address (known or not) or from one address (an IPv6
# /64), every log-in there is refused, the right password too, for LOGIN_LOCKOUT_S.
AUTHENTICATION_BACKENDS = ["marketplace.auth.ThrottledModelBackend"]
LOGIN_FAILURES_PER_ACCOUNT = env_int("LOGIN_FAILURES_PER_ACCOUNT", 5)
LOGIN_FAILURES_PER_ADDRESS = env_int("LOGIN_FAILURES_PER_ADDRESS", 20)
LOGIN_FAILURE_WINDOW_S = env_int("LOGIN_FAILURE_WINDOW_S", 15 * 60)
LOGIN_LOCKOUT_S = env_int("LOGIN_LOCKOUT_S", 15 * 60)
# Sign-up is finished from the link (or token) e-mailed to the address; it is valid this long.
SIGNUP_CONFIRM_TTL_S = env_int("SIGNUP_CONFIRM_TTL_S", 3 * 24 * 3600)
# Sign-up e-mails (confirm, or "you have an account") to one address: at most this many per window.
SIGNUP_EMAILS_PER_ADDRESS = env_int("SIGNUP_EMAILS_PER_ADDRESS", 3)
SIGNUP_EMAIL_WINDOW_S = env_int("SIGNUP_EMAIL_WINDOW_S", 3600)
# Password reset (Django's token, marketplace/services/passwords.py): the link works this long and once; at most
# this many reset e-mails to one address per window (the page answers the same whether the address has an account).
PASSWORD_RESET_TIMEOUT = env_int("PASSWORD_RESET_TIMEOUT_S", 3600)
PASSWORD_RESET_EMAILS_PER_ADDRESS = env_int("PASSWORD_RESET_EMAILS_PER_ADDRESS", 3)
PASSWORD_RESET_EMAIL_WINDOW_S = env_int("PASSWORD_RESET_EMAIL_WINDOW_S", 3600)
# API keys one account may hold at once (not revoked; expired ones count until revoked): a stolen session or key
# cannot mint keys without end, and a list stays one a person can review. Past it, making one is a 409.
API_KEYS_PER_USER_MAX = env_int("API_KEYS_PER_USER_MAX", 50)
# Volumes one renter may hold at once (being created or available), and their total size in GB: past either, a
# new one is a 409 naming the cap. The funds check (one hour of the whole burn rate) bounds paid storage; these
# bound it on nodes that price disk at zero, and a mistaken loop.
VOLUMES_PER_USER_MAX = env_int("VOLUMES_PER_USER_MAX", 50)
VOLUMES_TOTAL_GB_PER_USER_MAX = env_int("VOLUMES_TOTAL_GB_PER_USER_MAX", 128 * 1024)
# Two-factor log-in (optional, per user): the code step must follow the password within this many seconds.
TWO_FACTOR_LOGIN_TIMEOUT_S = env_int("TWO_FACTOR_LOGIN_TIMEOUT_S", 300)
# The Vast.ai-compatible API (compat/vast): an identical `create instance` (same user, offer id and body) within
# this many seconds of the first, while its instance is live, answers that instance instead of booking another
# (the vastai client re-sends a create up to 3 times, each after up to 120 s). docs/vast-cli.md.
COMPAT_CREATE_REPLAY_WINDOW_S = env_int("COMPAT_CREATE_REPLAY_WINDOW_S", 600)

AUTH_USER_MODEL = "marketplace.User"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
     "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
    # Every way a password is set (sign-up, change, reset, admin, createsuperuser) runs these: the same maximum as
    # sign-up's fields (marketplace.validators.PASSWORD_MAX_LENGTH; tests hold the two equal).
    {"NAME": "core.password_validation.MaximumLengthValidator", "OPTIONS": {"max_length": 128}},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "home"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "marketplace.api.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": ["core.api.filtering.FilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "core.api.pagination.Pagination",
    # A JSON API: form-encoded bodies silently drop empty optional fields and carry no types.
    "DEFAULT_PARSER_CLASSES": ["core.api.parsers.JSONParser"],  # DRF's, with too deep a body a 400
    # JSON answers only, errors included: no browsable-API HTML (the docs are the Swagger page at /api/docs/).
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "DEFAULT_SCHEMA_CLASS": "core.api.schema.AutoSchema",
    "DEFAULT_THROTTLE_RATES": {
        "auth": env_str("AUTH_THROTTLE_RATE", "20/min"),
        # Adding or changing a webhook endpoint, per user, the API and the settings page together: each may resolve
        # a host name the user chose, inside the web request (notifications/services/urls.py).
        "webhook_endpoints": env_str("WEBHOOK_ENDPOINT_THROTTLE_RATE", "10/min"),
        # Registering a node, per user, the API and the register page together: each resolves a host name the
        # provider chose inside the web request, and starts automatic SSH connections to it (review r54).
        "node_register": env_str("NODE_REGISTER_THROTTLE_RATE", "10/min"),
        # Changing a node's address, SSH port or user, per user, the API and the server's settings page together:
        # each change of a node the platform reached is an SSH connection, inside the web request, to the host and
        # port the provider typed, whose answer tells what listens there (review r55).
        "node_endpoint": env_str("NODE_ENDPOINT_THROTTLE_RATE", "10/min"),
    },
    "EXCEPTION_HANDLER": "core.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "GPU Marketplace API",
    "DESCRIPTION": (
        "Rent GPU servers by the second. Providers list verified hardware; renters search "
        "offers and book instances. Authenticate with `Authorization: Bearer <api key>`. "
        "Billing: a prepaid balance (top up with a saved card), charged per second while an instance is "
        "running at the price fixed at booking. A stopped instance is not charged for GPU time, but it keeps its "
        "disk, billed per second at its `disk_price_per_gb_month` (the node's published disk price at booking) "
        "until it starts again or is destroyed; a volume is billed per second at its `price_per_gb_month` from its "
        "creation until you delete it. Renting "
        "an instance or a volume, or starting an instance, needs one hour of everything you pay for (your running "
        "and starting instances' GPU time and your storage: volumes and stopped instances' disks) with the new one "
        "in the balance (else 402). Providers earn the price minus the published platform fee "
        "(`platform_fee_percent`)."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI served from our own static files: no CDN needed.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "NodeStateEnum": "marketplace.models.nodes.NodeState",
        "GpuStatusEnum": "marketplace.models.nodes.GpuStatus",
        "NotificationKindEnum": "notifications.models.Kind",
    },
}

# Celery: Redis (CELERY_BROKER_URL) in tests and production; the filesystem
# transport is the embedded default so that a first run needs no broker server.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL == "filesystem://":
    _broker_dir = VAR_DIR / "celery-broker"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(_broker_dir / "processed"),
        "store_processed": False,
        "control_folder": str(_broker_dir / "control"),
    }
    (_broker_dir / "processed").mkdir(parents=True, exist_ok=True)
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 900)
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 840)
CELERY_TIMEZONE = "UTC"
# Redis holds a delivered message (acks_late: until its task ends) and gives it to another worker only after this
# many seconds without an ack. It must outlast the longest a message is legitimately unacknowledged: waiting in a
# busy worker's reserve (up to one task time limit), then running (the time limit), plus a retry's countdown;
# shorter, and a long job runs twice. A lost worker's job does not wait for it: the dispatcher sends it again once
# its heartbeat is JOB_HEARTBEAT_STALE_S old (provisioning/services/runner.py). A short connect timeout keeps a
# request (or the dispatcher) from hanging on a broker that does not answer.
BROKER_VISIBILITY_TIMEOUT_S = env_int("BROKER_VISIBILITY_TIMEOUT_S", 2 * CELERY_TASK_TIME_LIMIT + 300)
if CELERY_BROKER_URL.split(":", 1)[0] in ("redis", "rediss", "redis+socket"):
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": BROKER_VISIBILITY_TIMEOUT_S,
                                       "socket_connect_timeout": env_int("CELERY_BROKER_CONNECT_TIMEOUT_S", 3)}
    # A prefix for every broker key (queues included): two deployments (or a test's own workers) can share one
    # Redis database without taking each other's tasks.
    if env_str("CELERY_BROKER_KEY_PREFIX", ""):
        CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] = env_str("CELERY_BROKER_KEY_PREFIX", "")
# Jobs are rows first (provisioning/services/jobs.py): the dispatcher sends jobs that were never sent (after
# JOB_SEND_GRACE_S), sent but not started (after JOB_RESEND_QUEUED_AFTER_S, then backing off), or whose running
# execution stopped beating for JOB_HEARTBEAT_STALE_S (it beats every JOB_HEARTBEAT_INTERVAL_S); a job whose
# worker was lost more than JOB_MAX_LOST_RUNS times fails.
JOB_DISPATCH_INTERVAL_S = env_int("JOB_DISPATCH_INTERVAL_S", 10)
JOB_SEND_GRACE_S = env_int("JOB_SEND_GRACE_S", 5)
JOB_RESEND_QUEUED_AFTER_S = env_int("JOB_RESEND_QUEUED_AFTER_S", 120)
# Hand new jobs to the broker from a sender thread after commit, in batches, so that a booking does not wait
# for the broker (provisioning/services/jobs.py). Off with SQLite: its single writer would be contended.
JOB_SEND_IN_BACKGROUND = env_bool("JOB_SEND_IN_BACKGROUND", DATABASES["default"]["ENGINE"].endswith("postgresql"))
# Or leave new jobs to the job relay (scripts/run-relay, one or more per deployment; provisioning/services/relay.py),
# which a NOTIFY wakes when they commit and which sends them in batches: the web processes then spend nothing on
# the broker. PostgreSQL only (LISTEN/NOTIFY). Without a relay running, the dispatcher still sends them
# (JOB_SEND_GRACE_S, then every JOB_DISPATCH_INTERVAL_S).
JOB_RELAY = env_bool("JOB_RELAY", DATABASES["default"]["ENGINE"].endswith("postgresql"))
# How often a relay looks for unsent jobs with no NOTIFY (a missed one: its connection was being re-opened).
JOB_RELAY_POLL_S = float(env_str("JOB_RELAY_POLL_S", "5"))
JOB_HEARTBEAT_INTERVAL_S = float(env_str("JOB_HEARTBEAT_INTERVAL_S", "10"))
JOB_HEARTBEAT_STALE_S = env_int("JOB_HEARTBEAT_STALE_S", 45)
JOB_MAX_LOST_RUNS = env_int("JOB_MAX_LOST_RUNS", 3)
# Seconds before each retry of a job whose node did not answer (one entry per retry).
NODE_TASK_RETRY_BACKOFF_S = [float(s) for s in env_list("NODE_TASK_RETRY_BACKOFF_S", ["5", "15", "45"])]
# Seconds before a job tries again when the node is busy (all its SSH slots taken); retried until the job's
# deadline, without using up the retries above.
NODE_BUSY_RETRY_S = env_int("NODE_BUSY_RETRY_S", 30)
# Connection attempts within one try, and the first pause between them (doubled each time).
NODE_CONNECT_ATTEMPTS = env_int("NODE_CONNECT_ATTEMPTS", 3)
NODE_CONNECT_BACKOFF_S = float(env_str("NODE_CONNECT_BACKOFF_S", "1"))
# The benchmark check (docs/BENCHMARKS.md): its time bound on the node (the SSH command waits 30 s longer),
# and quick mode (tests).
BENCHMARK_TIME_LIMIT_S = env_int("BENCHMARK_TIME_LIMIT_S", 300)
BENCHMARK_QUICK = env_bool("BENCHMARK_QUICK", False)
# The platform's own network test in every verification: this many bytes sent to the node over SSH (0: skipped).
NET_TEST_BYTES = env_int("NET_TEST_BYTES", 16 << 20)
# Re-checks at random times (provisioning/services/maintenance.py, docs/ARCHITECTURE.md "Watch"): when a
# verification of a node ends, its next full verification is drawn (secrets, uniform) between REVERIFY_MIN_S and
# REVERIFY_MAX_S later (defaults: 4 to 10 days, a week on average); between full checks, spot checks of its idle
# GPUs (the platform's challenge and memory proof) come SPOT_CHECK_MIN_S plus an exponential (memoryless) gap
# apart, at most SPOT_CHECK_MAX_S, SPOT_CHECK_MEAN_S on average (defaults: 15 min floor, 72 h at most, a day on
# average, as the uniform 6 to 42 h before): a spot check just ended promises no quiet time (about 4 % chance of
# another within the hour, whenever: verification.draw_spot_gap). A dodged spot check brings the full verification
# forward, at most one per SPOT_CHECK_FORWARD_MIN_S after the last. The beat looks for due nodes every
# REVERIFY_BEAT_S.
REVERIFY_MIN_S = env_int("REVERIFY_MIN_S", 4 * 24 * 3600)
REVERIFY_MAX_S = env_int("REVERIFY_MAX_S", 10 * 24 * 3600)
SPOT_CHECK_MIN_S = env_int("SPOT_CHECK_MIN_S", 15 * 60)
SPOT_CHECK_MEAN_S = env_int("SPOT_CHECK_MEAN_S", 24 * 3600)
SPOT_CHECK_MAX_S = env_int("SPOT_CHECK_MAX_S", 72 * 3600)
SPOT_CHECK_FORWARD_MIN_S = env_int("SPOT_CHECK_FORWARD_MIN_S", 6 * 3600)
REVERIFY_BEAT_S = env_int("REVERIFY_BEAT_S", 300)
# A node's provider may ask for its verification again (POST /api/v1/nodes/{id}/verify/, the Verify button) only
# this long after its last verification that ended with a verdict (passed, degraded or rejected; whoever asked for
# it): each check costs the platform CPU (the challenge's recomputation, the memory proof) and SSH work, and a
# verdict is not re-rolled on demand until a lucky draw passes. A check that ended without one (unreachable, the key
# refused, a host key, the platform's own failure) starts none. Operators and the platform's own checks are not
# bound by it (verification.node_verify_request, by_provider). 0: no cooldown.
NODE_VERIFY_COOLDOWN_S = env_int("NODE_VERIFY_COOLDOWN_S", 15 * 60)
# A GPU model's fleet reference (the median, over providers, of what its verified nodes measured) is used once this
# many other nodes of the model, of this many other providers, have a measured latest run; fewer, and nodes are
# judged against the datasheet only.
FLEET_REFERENCE_MIN_NODES = env_int("FLEET_REFERENCE_MIN_NODES", 5)
# Whether a provider may register a node of the `sim` runtime (simulated GPUs: tests and demos). Its checks are
# sized for a CPU, so a GPU-less box running the sim agent with an honest profile would pass them: off unless set
# (config/settings/local.py and test.py turn it on).
SIM_NODES_ALLOWED = env_bool("SIM_NODES_ALLOWED", False)
# The networks (IPs or CIDRs), besides public addresses, that providers' nodes may be in (core/addresses.py,
# node_address_allowed): checked when a node is registered and again at every connection the workers open to it,
# so that a provider cannot make them connect inside the platform's own network. None by default; list a private
# VPN that providers' servers are on. config/settings/local.py and test.py allow loopback (the simulated nodes'
# sshds); production refuses loopback, link-local and unspecified networks here.
NODE_ADDRESS_ALLOWED_NETWORKS = env_networks("NODE_ADDRESS_ALLOWED_NETWORKS", [])
# A provider's live nodes that never proved they control their server (Node.control_proven_at: the platform's key
# not installed, or nothing answering at the address yet) at one time: each is retried by SSH on its own
# (provisioning.services.maintenance.nodes_verify_pending), so a registration past it is a 409 until one passes
# its first contact or is retired (marketplace.services.nodes.node_register; review r54).
NODE_PENDING_MAX = env_int("NODE_PENDING_MAX", 10)
# Registries inside a node's network (`host` or `host:port`, lower case) that a renter's own image may still name
# (marketplace/services/instances/options.py clean_own_image_reference refuses localhost and non-public IPs).
# None by default; the docker tests' registry on 127.0.0.1 is allowed by them alone. Nodes' agents keep their own
# list (GPUMARKET_INTERNAL_REGISTRIES).
RENTER_INTERNAL_REGISTRIES = [r.lower() for r in env_list("RENTER_INTERNAL_REGISTRIES", [])]
FLEET_REFERENCE_MIN_PROVIDERS = env_int("FLEET_REFERENCE_MIN_PROVIDERS", 3)

HEALTH_CHECK_INTERVAL_S = env_int("HEALTH_CHECK_INTERVAL_S", 60)
RECONCILE_INTERVAL_S = env_int("RECONCILE_INTERVAL_S", 300)
# The node's record of a failed instance's VM whose container or domain is missing is removed by the reconciler
# only once the instance has been failed this long: an engine that came back on an empty data root has time to find
# its containers again (provisioning/services/reconcile.py _forget_missing).
VM_FORGET_MISSING_AFTER_S = env_int("VM_FORGET_MISSING_AFTER_S", 3600)
# The fleet's health checks and reconciles run as batch tasks of this many nodes each, which any worker takes
# (provisioning/services/fleet.py). Each worker process keeps up to FLEET_SSH_POOL_SIZE SSH connections to nodes
# open between checks, closing one idle for FLEET_SSH_POOL_IDLE_S (provisioning/ssh_pool.py).
FLEET_BATCH_SIZE = env_int("FLEET_BATCH_SIZE", 250)
FLEET_SSH_POOL_SIZE = env_int("FLEET_SSH_POOL_SIZE", 2000)
FLEET_SSH_POOL_IDLE_S = env_int("FLEET_SSH_POOL_IDLE_S", 300)
CELERY_BEAT_SCHEDULE = {
    "jobs-dispatch": {"task": "provisioning.tasks.jobs_dispatch", "schedule": JOB_DISPATCH_INTERVAL_S,
                      "options": {"expires": max(JOB_DISPATCH_INTERVAL_S - 1, 1)}},
    # The fleet's dispatchers: a tick not taken within (a bit under) its interval is dropped, so a backlog queued
    # while the fleet workers were busy or restarting does not run as a burst of cycles, each checking every node
    # again (a node silent for a moment then got several failed checks at once: its renters interrupted, the node
    # offline). The dispatcher also refuses a cycle too soon after the last one (fleet._dispatch).
    "nodes-health-check": {"task": "provisioning.tasks.nodes_health_check", "schedule": HEALTH_CHECK_INTERVAL_S,
                           "options": {"expires": max(HEALTH_CHECK_INTERVAL_S - 5, 1)}},
    "nodes-reconcile": {"task": "provisioning.tasks.nodes_reconcile", "schedule": RECONCILE_INTERVAL_S,
                        "options": {"expires": max(RECONCILE_INTERVAL_S - 5, 1)}},
    "jobs-reap": {"task": "provisioning.tasks.jobs_reap", "schedule": 60},
    "nodes-verify-pending": {"task": "provisioning.tasks.nodes_verify_pending", "schedule": 60},
    "nodes-reverify-due": {"task": "provisioning.tasks.nodes_reverify_due", "schedule": REVERIFY_BEAT_S},
    # Billing: close usage intervals of running instances (and act on low and empty balances) every
    # minute; pay providers their earnings once a week (for the week before, from Monday 03:00 UTC). The payout run
    # is every day at 03:00: a payout is made once per (provider, week), so Monday's run pays the week, and the
    # others pay only what it missed (a beat down or recreated over Monday 03:00 skipped the week: review r54).
    "billing-meter": {"task": "billing.tasks.usage_meter_tick",
                      "schedule": env_int("BILLING_METER_INTERVAL_S", 60),
                      "options": {"expires": max(env_int("BILLING_METER_INTERVAL_S", 60) - 5, 5)}},
    # Top-ups still processing after BILLING_TOP_UP_RECONCILE_AFTER_S (their webhook never came), and refunds and
    # payouts whose Stripe answer was lost, are settled with what Stripe says.
    "billing-top-ups-reconcile": {"task": "billing.tasks.top_ups_reconcile", "schedule": 60,
                                  "options": {"expires": 55}},
    # Deactivated accounts: what came to run after their deactivation's pass is stopped (and billed no longer).
    "accounts-deactivated-sweep": {"task": "marketplace.tasks.accounts_deactivated_sweep", "schedule": 60,
                                   "options": {"expires": 55}},
    "billing-payouts": {"task": "billing.tasks.payouts_run", "schedule": crontab(minute="0", hour="3")},
    # Webhook deliveries whose next attempt is overdue (a broker outage, a lost retry) are queued again.
    "notifications-deliveries-resend": {"task": "notifications.tasks.deliveries_resend", "schedule": 60,
                                        "options": {"expires": 55}},
    # E-mails of notifications still to send five minutes after they were due (the same causes), or whose worker
    # was lost while sending, are queued again; past 24 h or 8 attempts they are given up, recorded.
    "notifications-emails-resend": {"task": "notifications.tasks.emails_resend", "schedule": 60,
                                    "options": {"expires": 55}},
    # Finished webhook deliveries older than NOTIFICATIONS_WEBHOOK_LOG_DAYS are deleted, with their attempts.
    "notifications-deliveries-prune": {"task": "notifications.tasks.deliveries_prune",
                                       "schedule": crontab(minute="30", hour="4")},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

# Money and the marketplace's published terms.
PLATFORM_FEE_PERCENT = env_decimal("PLATFORM_FEE_PERCENT", Decimal("15"))
STRIPE_SECRET_KEY = env_str("STRIPE_SECRET_KEY", "sk_test_local")
STRIPE_PUBLISHABLE_KEY = env_str("STRIPE_PUBLISHABLE_KEY", "pk_test_local")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET", "whsec_local")
STRIPE_API_BASE = env_str("STRIPE_API_BASE", "")  # empty: Stripe's own servers
# Connect transfers (payouts) may go elsewhere than the rest (localstripe has no Connect); empty: STRIPE_API_BASE.
STRIPE_CONNECT_API_BASE = env_str("STRIPE_CONNECT_API_BASE", "")
STRIPE_MAX_NETWORK_RETRIES = env_int("STRIPE_MAX_NETWORK_RETRIES", 2)
STRIPE_TIMEOUT_S = env_int("STRIPE_TIMEOUT_S", 20)
# Where the balance page loads Stripe.js (with a real publishable key); another origin (localstripe's stand-in at
# <localstripe>/js.stripe.com/v3/) is allowed by the Content-Security-Policy in Stripe's place.
STRIPE_JS_URL = env_str("STRIPE_JS_URL", "https://js.stripe.com/v3/")

# Content-Security-Policy on every response (config/settings/csp.py): our own origin plus Stripe.js. Violations
# are reported to CSP_REPORT_URI when it is set.
CONTENT_SECURITY_POLICY = content_security_policy(stripe_js_url=STRIPE_JS_URL,
                                                  report_uri=env_str("CSP_REPORT_URI", ""))

# Billing (billing/; docs in the API schema). Money is integer micro-dollars; these are whole USD or seconds.
BILLING_REQUIRE_FUNDS = env_bool("BILLING_REQUIRE_FUNDS", True)  # renting needs 1 h of the whole burn rate
BILLING_FUNDS_REQUIRED_S = env_int("BILLING_FUNDS_REQUIRED_S", 3600)
BILLING_LOW_BALANCE_WARNING_S = env_int("BILLING_LOW_BALANCE_WARNING_S", 3600)  # warn below this much run time
BILLING_GRACE_PERIOD_S = env_int("BILLING_GRACE_PERIOD_S", 3 * 24 * 3600)  # stopped at zero; destroyed after this
BILLING_DESTROY_WARNING_S = env_int("BILLING_DESTROY_WARNING_S", 24 * 3600)  # warn this long before destroying
BILLING_TOP_UP_MIN_USD = env_decimal("BILLING_TOP_UP_MIN_USD", Decimal("5"))
BILLING_TOP_UP_MAX_USD = env_decimal("BILLING_TOP_UP_MAX_USD", Decimal("10000"))
# A top-up still processing this long (its webhook has not come) is looked up at Stripe, and again this long after.
BILLING_TOP_UP_RECONCILE_AFTER_S = env_int("BILLING_TOP_UP_RECONCILE_AFTER_S", 300)
BILLING_PAYOUT_MINIMUM_USD = env_decimal("BILLING_PAYOUT_MINIMUM_USD", Decimal("25"))
BILLING_METER_BATCH_SIZE = env_int("BILLING_METER_BATCH_SIZE", 10_000)
BILLING_DEMO_CREDIT_USD = env_decimal("BILLING_DEMO_CREDIT_USD", Decimal("100"))
# Interruptions (published at /api/v1/billing/terms/): a running instance whose node misses this many health
# checks in a row (or whose VM stops running) is `interrupted`; billing stops at the last healthy moment, and
# the renter is credited this multiple of the price of the time lost (at most INTERRUPTION_CREDIT_MAX_S of it
# per interruption), charged to the provider's earnings.
NODE_INTERRUPT_AFTER_FAILED_CHECKS = env_int("NODE_INTERRUPT_AFTER_FAILED_CHECKS", 2)
INTERRUPTION_CREDIT_MULTIPLE = env_decimal("INTERRUPTION_CREDIT_MULTIPLE", Decimal("1"))
INTERRUPTION_CREDIT_MAX_S = env_int("INTERRUPTION_CREDIT_MAX_S", 24 * 3600)
# A re-verification that scores a rented node lower than before by more than this share cuts its renters' price
# in proportion (a rejection without a score: to zero). Also published.
HARDWARE_PRICE_CUT_TOLERANCE = env_decimal("HARDWARE_PRICE_CUT_TOLERANCE", Decimal("0.05"))

# Where the platform tells providers it will connect from and what it is called.
PLATFORM_NAME = env_str("PLATFORM_NAME", "gpumarket")
OTP_TOTP_ISSUER = PLATFORM_NAME  # the name authenticator apps show
# The site's address as its users reach it (https://gpus.example.com/): the absolute one-click unsubscribe link of
# notification e-mails (notifications/services/unsubscribe.py), which the worker sends with no request to read it
# from. Empty: those e-mails carry no List-Unsubscribe header.
SITE_URL = env_str("SITE_URL", "")
SIMNODES_DIR = Path(env_str("SIMNODES_DIR", str(VAR_DIR / "simnodes")))

# E-mail: by default each message is written to a file under EMAIL_FILE_PATH (var/mail/; the demo's inbox: the
# sign-up and password-reset links are there). Production sets EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend
# and the SMTP server below: sign-up and password reset finish from an e-mail.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
EMAIL_FILE_PATH = Path(env_str("EMAIL_FILE_PATH", str(VAR_DIR / "mail")))
# Outgoing webhooks (notifications/services/webhooks.py): one POST per attempt with this timeout; a failed one is
# retried after BACKOFF_S, doubled each time, up to MAX_ATTEMPTS in all. ALLOW_LOOPBACK (tests and local demos
# only) lets endpoints be http://127.0.0.1; otherwise only https to public addresses.
NOTIFICATIONS_WEBHOOK_TIMEOUT_S = env_int("NOTIFICATIONS_WEBHOOK_TIMEOUT_S", 5)
NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = env_int("NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS", 8)
NOTIFICATIONS_WEBHOOK_BACKOFF_S = float(env_str("NOTIFICATIONS_WEBHOOK_BACKOFF_S", "30"))
NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = env_bool("NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK", False)
# Test events one user may send an hour (each is up to NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS requests to their URL).
NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR = env_int("NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR", 10)
# Days a finished webhook delivery (delivered or given up) and its attempts are kept for the user to read; a daily
# beat job deletes older ones (notifications/services/retention.py).
NOTIFICATIONS_WEBHOOK_LOG_DAYS = env_int("NOTIFICATIONS_WEBHOOK_LOG_DAYS", 30)
# The CA certificates (a PEM file) that endpoints' certificates must chain to; empty: certifi's public CAs. The
# environment's REQUESTS_CA_BUNDLE and proxies are not read: an attempt connects to the address it checked.
NOTIFICATIONS_WEBHOOK_CA_BUNDLE = env_str("NOTIFICATIONS_WEBHOOK_CA_BUNDLE", "")
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "gpumarket <noreply@localhost>")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT_S", 20)

# Logs: one line per record on stderr, carrying the job, node, instance and Celery task it is about when the code
# that logs has bound them (core/logging_context.py). LOG_FORMAT=json (production's default: one JSON object per
# line, python-json-logger) or plain (the default elsewhere).
LOG_FORMATS = ("plain", "json")


def log_format(default: str) -> str:
    value = env_str("LOG_FORMAT", default)
    if value not in LOG_FORMATS:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(f"LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, not {value!r}")
    return value


LOG_FORMAT = log_format("plain")
LOGGING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"context": {"()": "core.logging_context.ContextFilter"}},
    "formatters": {
        "plain": {"()": "core.logging_context.PlainFormatter",
                  "format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "core.logging_context.JsonFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "filters": ["context"]}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
# Celery workers log through LOGGING above (the same format and ids as the web), not through handlers of their own.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# GET /metrics (core/metrics.py) for Prometheus: allowed with `Authorization: Bearer <METRICS_TOKEN>` (when set)
# or to a staff user's session; anyone else gets a 404 (a wrong token: 401). PROMETHEUS_MULTIPROC_DIR (read by
# prometheus_client itself) makes the histograms and counters of every gunicorn and Celery process of this host
# add up in that directory (see docs/SCALING.md "Metrics").
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
