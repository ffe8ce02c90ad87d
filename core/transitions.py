"""Declared state machines: one small helper that every stateful model uses.

A model declares its table once (`{state: {next states}}`) as a `Transitions`, and mixes in `StatefulModel`:
`transition_to` is then the only way its code moves the state, and raises InvalidTransition (a 409 Conflict)
for a move the table does not allow. Set-based updates filter on `sources_of(target)`, so the table stays the one
rule there too; `actions` name the moves people ask for (a button, an API verb) so that pages and services read
which state allows which action from the same place. `check_constraint` is the database's copy of the states.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

from django.core.exceptions import ValidationError
from django.db import models

from core.errors import Conflict


class InvalidTransition(Conflict):
    """A state change the table does not allow (409): e.g. "node 5 cannot go from retired to active"."""

    def __init__(self, label: str, current: str, target: str):
        self.current = current
        self.target = target
        super().__init__(f"{label} cannot go from {current} to {target}")


class Transitions(Mapping[str, frozenset[str]]):
    """A transition table, read as a mapping {state: next states}. `actions` maps an action's name to (its target,
    the states it may start from, or None for every state that may reach the target); each must be a move the
    table allows (checked here, at import)."""

    def __init__(self, table: Mapping[str, Iterable[str]], *,
                 actions: Mapping[str, tuple[str, Iterable[str] | None]] | None = None):
        self.table: dict[str, frozenset[str]] = {str(s): frozenset(str(t) for t in nxt) for s, nxt in table.items()}
        unknown = {t for nxt in self.table.values() for t in nxt} - self.table.keys()
        if unknown:
            raise ValueError(f"transitions to undeclared states: {sorted(unknown)}")
        self.actions: dict[str, tuple[str, frozenset[str]]] = {}
        for name, (target, sources) in (actions or {}).items():
            allowed = self.sources_of(target)
            chosen = allowed if sources is None else frozenset(str(s) for s in sources)
            if not chosen <= allowed:
                raise ValueError(f"action {name}: {sorted(chosen - allowed)} cannot go to {target}")
            self.actions[name] = (str(target), chosen)

    def __getitem__(self, state: str) -> frozenset[str]:
        return self.table[state]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def states(self) -> frozenset[str]:
        return frozenset(self.table)

    @property
    def final(self) -> frozenset[str]:
        """States with no way out."""
        return frozenset(s for s, nxt in self.table.items() if not nxt)

    def can(self, current: str, target: str) -> bool:
        return target in self.table.get(current, ())

    def check(self, label: str, current: str, target: str) -> None:
        if not self.can(current, target):
            raise InvalidTransition(label, current, target)

    def sources_of(self, target: str) -> frozenset[str]:
        """The states that may move to `target` (for set-based updates: `.filter(status__in=...)`)."""
        return frozenset(s for s, nxt in self.table.items() if target in nxt)

    def action_allowed(self, action: str, current: str) -> bool:
        return current in self.actions[action][1]

    def action_sources(self, action: str) -> frozenset[str]:
        return self.actions[action][1]

    def action_target(self, action: str) -> str:
        return self.actions[action][0]

    def check_constraint(self, field: str, name: str) -> models.CheckConstraint:
        """The database's copy: the field holds one of the declared states."""
        return models.CheckConstraint(condition=models.Q(**{f"{field}__in": sorted(self.table)}), name=name)


class StatefulModel:
    """Mixin for a model on a declared table: `transitions`, and the field that holds the state."""

    transitions: ClassVar[Transitions]
    state_field: ClassVar[str] = "status"

    def _label(self) -> str:
        meta: Any = getattr(self, "_meta")  # noqa: B009 (a mixin: Django's Model supplies _meta)
        return f"{meta.verbose_name} {getattr(self, 'pk', None)}"

    def can_transition_to(self, target: str) -> bool:
        return self.transitions.can(getattr(self, self.state_field), target)

    @classmethod
    def transition_rows(cls, queryset: models.QuerySet[Any], target: str, *, action: str | None = None,
                        **values: Any) -> int:
        """Set-based: move the rows of `queryset` that the table lets go to `target` (only those `action` may
        start from, when given), writing `values` too; the number moved."""
        if action is not None and cls.transitions.action_target(action) != target:
            raise ValueError(f"action {action} does not go to {target}")
        sources = cls.transitions.action_sources(action) if action else cls.transitions.sources_of(target)
        return queryset.filter(**{f"{cls.state_field}__in": sorted(sources)}).update(
            **{cls.state_field: target}, **values)

    def clean(self) -> None:
        """A form (the admin's) may change the state only along the table (one query, on forms only)."""
        super().clean()  # type: ignore[misc]
        pk = getattr(self, "pk", None)
        if pk is None:
            return
        stored = type(self)._default_manager.filter(pk=pk).values_list(  # type: ignore[attr-defined]
            self.state_field, flat=True).first()
        current = getattr(self, self.state_field)
        if stored is not None and stored != current and not self.transitions.can(stored, current):
            raise ValidationError({self.state_field: f"It cannot go from {stored} to {current}."})

    def allows(self, action: str) -> bool:
        """May `action` (one of the table's named actions) be asked for in the current state?"""
        return self.transitions.action_allowed(action, getattr(self, self.state_field))

    def transition_to(self, target: str) -> None:
        """Move to `target` in memory; the caller saves. Raises InvalidTransition."""
        self.transitions.check(self._label(), getattr(self, self.state_field), target)
        setattr(self, self.state_field, target)
