# One image for web, worker and beat (docker-compose.yml picks the command).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=config.settings.production VAR_DIR=/app/var

RUN apt-get update && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 app

WORKDIR /app
# The platform's runtime set, exactly as `make demo` installs it (tests/test_demo_install.py checks the two
# agree; scripts/demo-smoke installs it into a fresh environment and runs the demo on it).
COPY requirements.txt constraints.txt ./
RUN pip install -r requirements.txt -c constraints.txt

COPY . .
# var/metrics: the shared volume of Prometheus multiprocess files (docker-compose.yml), writable by app.
RUN mkdir -p var/metrics && chown -R app:app var
USER app
EXPOSE 8000
CMD ["scripts/run-web"]
