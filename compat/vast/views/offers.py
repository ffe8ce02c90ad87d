"""`search offers`: POST /api/v0/bundles/ through the same FilterSet and selector as GET /api/v1/offers/."""

from rest_framework import permissions
from rest_framework.response import Response

from core.api.renderers import FastJSONRenderer
from core.api.scopes import PUBLIC

from .. import offers, query
from .base import VastView


class OffersSearchView(VastView):
    """POST /api/v0/bundles/: `vastai search offers`. Public, like GET /api/v1/offers/."""

    api_scope = PUBLIC  # core/api/scopes.py
    api_read_methods = frozenset({"POST"})  # the search is a POST by Vast's protocol, and only reads: `read` keys too
    permission_classes = [permissions.AllowAny]
    renderer_classes = [FastJSONRenderer]  # thousands of rows per search; the same JSON as JSONRenderer

    def post(self, request):
        return Response({"offers": offers.offers_find(query.parse(request.data))})
