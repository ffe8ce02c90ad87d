"""DRF's throttles, counting by the client's address as core.client_address reads it (TRUSTED_PROXIES), not by
DRF's NUM_PROXIES rule: every API throttle must come from here."""
from rest_framework import throttling
from rest_framework.request import Request

from core.client_address import client_ip, throttle_ident


class ClientAddressMixin:
    def get_ident(self, request: Request) -> str:
        return throttle_ident(client_ip(request))


class ScopedRateThrottle(ClientAddressMixin, throttling.ScopedRateThrottle):
    pass


class AnonRateThrottle(ClientAddressMixin, throttling.AnonRateThrottle):
    pass


class UserRateThrottle(ClientAddressMixin, throttling.UserRateThrottle):
    pass
