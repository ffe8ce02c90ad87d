"""Rows built once for a whole test module instead of once per test, as Django's TestCase.setUpTestData builds them
once per class: inside an atomic block opened before the module's first test that wants them and rolled back after
its last test. Each test still runs in its own transaction inside that block (pytest-django's `db`), so what a test
writes is rolled back after it and the next test sees the rows as built.

Building a market through node_register (tests/factories.py) costs ~25 ms of CPU a node: the search tests built the
same few dozen nodes again for each of their cases, most of those modules' time.

A test of the module that did not ask for the rows, running while they are in the database, fails by name
(`require_absent`): it would see nodes it did not make."""
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import transaction

from tests import reference_data

_built: set[str] = set()  # the modules whose rows are in the database now


@contextmanager
def rows_for_module(request: pytest.FixtureRequest, django_db_blocker: Any, build: Callable[[], Any]) -> Iterator[Any]:
    """For a module-scoped fixture (that also asks for `django_db_setup`): build() once, its result for the module's
    tests, its rows rolled back at the module's end."""
    module = request.module.__name__
    with django_db_blocker.unblock():
        # The snapshot of the migrated tables (tests/conftest.py _reference_data) must not hold these rows; and an
        # earlier transactional test may have emptied the catalogue the build reads.
        reference_data.take_snapshot()
        block = transaction.atomic()
        block.__enter__()
        # As TestCase's own blocks: a durable block may open inside it (only a test's may hold one otherwise).
        block._from_testcase = True  # type: ignore[attr-defined]
        try:
            reference_data.restore()
            built = build()
        except BaseException:
            transaction.set_rollback(True)
            block.__exit__(None, None, None)
            raise
    _built.add(module)
    try:
        yield built
    finally:
        _built.discard(module)
        with django_db_blocker.unblock():
            transaction.set_rollback(True)
            block.__exit__(None, None, None)


def require_absent(request: pytest.FixtureRequest, fixture: str) -> None:
    """Fail a test that does not use `fixture` while its module's rows are built (tests that do not use them must come
    before the first one that does)."""
    if fixture not in request.fixturenames and request.module.__name__ in _built:
        pytest.fail(f"{request.node.name} runs with the rows of `{fixture}` in the database: move it above the "
                    f"module's first test that uses `{fixture}`", pytrace=False)
