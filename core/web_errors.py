"""The one mapping of domain errors to the pages (the API's is core.api.errors).

A page shows an ApplicationError's message as it is, on the form's field at fault when the form has that field
(`exc.field`), else above the form or as a django.contrib.messages error. Where the pages word an error class
differently on purpose (a refusal whose message names an API endpoint), the web layer registers its wording once
with `page_wording`, and every page uses it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django import forms
from django.contrib import messages
from django.http import HttpRequest

from core.errors import ApplicationError, ValidationFailed

E = TypeVar("E", bound=ApplicationError)

_WORDINGS: dict[type[ApplicationError], Callable[[Any], str]] = {}


def page_wording(error_class: type[E]) -> Callable[[Callable[[E], str]], Callable[[E], str]]:
    """Register how the pages word `error_class` and its subclasses (a decorator of `(exc) -> str`)."""

    def register(wording: Callable[[E], str]) -> Callable[[E], str]:
        _WORDINGS[error_class] = wording
        return wording

    return register


def error_message(exc: ApplicationError) -> str:
    """What a page says for the error: its registered page wording, or the service's message."""
    for cls in type(exc).__mro__:
        wording = _WORDINGS.get(cls)
        if wording is not None:
            return wording(exc)
    return exc.message


def form_error(form: forms.BaseForm, exc: ApplicationError, *, default_field: str | None = None) -> None:
    """Show the error on the form: on its own field (`exc.field`, or else `default_field`) when the form has that
    field, else above the form."""
    if isinstance(exc, ValidationFailed) and len(exc.errors) > 1:
        for field, texts in exc.errors.items():
            for text in texts:
                form.add_error(field if field in form.fields else None, text)
        return
    name = exc.field or default_field
    form.add_error(name if name in form.fields else None, error_message(exc))


def message_error(request: HttpRequest, exc: ApplicationError) -> None:
    """Show the error as a messages error on the next page (after a redirect)."""
    messages.error(request, error_message(exc))
