"""Celery reads its options from Django's CELERY_* settings (config/celery.py's DjangoCeleryConfig), live."""
from config.celery import DjangoCeleryConfig, app


def test_celery_reads_the_django_settings_it_is_given(settings):
    assert app.conf.task_acks_late is True and app.conf.worker_prefetch_multiplier == 1
    assert app.conf.broker_url == settings.CELERY_BROKER_URL
    assert app.conf.task_serializer == "json"  # not set in Django: Celery's default
    assert "CELERY_TASK_ACKS_LATE" in DjangoCeleryConfig() and "task_acks_late" not in DjangoCeleryConfig()
    assert "DEBUG" not in DjangoCeleryConfig()  # only the CELERY_ namespace


def test_an_overridden_setting_is_seen_even_one_django_did_not_define(settings):
    settings.CELERY_TASK_TIME_LIMIT = 123
    settings.CELERY_TASK_DEFAULT_PRIORITY = 7  # a name the settings never had
    assert app.conf.task_time_limit == 123 and app.conf.task_default_priority == 7
    del settings.CELERY_TASK_DEFAULT_PRIORITY
    assert app.conf.task_default_priority is None
