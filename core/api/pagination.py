"""Pagination for every API list: page numbers from 1, and a 400 for a malformed page or size."""
from __future__ import annotations

import re
from typing import Any

from django.core.paginator import Paginator
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request
from rest_framework.views import APIView

PAGE_MAX = 999_999_999  # the largest page number read (9 ASCII digits); the schema says so


class Pagination(PageNumberPagination):
    """Page numbers from 1; a malformed `page` or `page_size` is a 400 naming it, not silently ignored."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200
    last_page_strings = ()  # `page` is an integer, as the schema says
    # A page past the last stays DRF's 404, but says which page and why (Django's "That page contains no results").
    invalid_page_message = "Page {page_number} does not exist: {message}"

    def get_page_size(self, request: Request) -> int:
        return self._positive_int(request, self.page_size_query_param, self.page_size, self.max_page_size)

    def get_page_number(self, request: Request, paginator: Paginator[Any]) -> int:
        return self._positive_int(request, self.page_query_param, 1, None)

    @staticmethod
    def _positive_int(request: Request, name: str, default: int, maximum: int | None) -> int:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        # ASCII digits only, as the schema's integer: int() also took "١" (Arabic-Indic one), "1_0", "+1", " 1 ".
        value = int(raw) if re.fullmatch(r"[0-9]{1,9}", raw, re.ASCII) else 0
        maximum = maximum if maximum is not None else PAGE_MAX
        if value < 1 or value > maximum:
            bound = f" and at most {maximum}"
            raise ValidationError({name: [f"Must be a whole number of at least 1{bound}."]})
        return value

    def get_schema_operation_parameters(self, view: APIView) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"]["minimum"] = 1
            # What _positive_int reads: at most 9 digits (a page past the last is a 404).
            parameter["schema"]["maximum"] = self.max_page_size if parameter["name"] == self.page_size_query_param \
                else PAGE_MAX
        return parameters
