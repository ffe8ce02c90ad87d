"""The data-migration tests take the database back to an old migration and forward again with Django's
MigrationExecutor. Going back, Django first works out the project state before each migration it unapplies: it
walks the plan a clean database would follow from the first of them to the last, with every model rendered, and
re-renders the models each step touches, of the migrations it unapplies and of every other migration applied in
between (going back to billing 0012: 52 other apps' migrations, 173 operations, the ones it unapplies only 50).
Here the same plan is unapplied, in the same order, in runs of migrations that are neighbours in that clean plan:
each run renders the state once, at its first migration, and walks nothing else. The state before each migration is
the one Django's single call builds (the migrations applied when the first run started that precede it in the clean
plan: the loader's list of applied migrations is read once, before the first run, as Django reads it once); so the
same operations run against the same states, and the database ends where `executor.migrate(targets)` leaves it."""
from django.db.migrations.executor import MigrationExecutor


def migrate(executor: MigrationExecutor, targets=None) -> None:
    """To `targets` (backwards: in runs, as above), or (None) to the latest migration of every app (one call: going
    forward Django renders the state once and walks only the migrations it applies)."""
    graph = executor.loader.graph
    if targets is None:
        executor.migrate(graph.leaf_nodes())
        return
    plan = executor.migration_plan(targets)
    if not plan or not all(backwards for _, backwards in plan):
        executor.migrate(targets, plan=plan)
        return
    clean = {migration: i for i, (migration, _) in enumerate(
        executor.migration_plan(graph.leaf_nodes(), clean_start=True))}
    runs: list[list] = []
    for step in plan:
        if runs and clean[step[0]] == clean[runs[-1][-1][0]] - 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    for run in runs:
        executor.migrate(targets, plan=run)
