"""The API toolkit every app's API imports, owned by none of them: the one mapping of ApplicationError to an
answer (errors), serializer fields (fields), strict filters and query parameters (filtering), pagination, the
Idempotency-Key header (idempotency), the OpenAPI generation (schema) and the throttles (throttling).

It may import Django, DRF, drf-spectacular and the rest of core; never an app.
"""
