"""The per-row shortcuts of the Vast search (compat.vast.offers, compat.vast.query) answer exactly as the plain
rules they replace: `matcher` as `matches` for every operator and kind of value, `usd` as the Decimal conversion for
every amount. The search's answers are held to the plain rules end to end in test_offers_scan.py."""
import random
from decimal import Decimal

from compat.vast import query
from compat.vast.offers import usd
from core.money import micros_to_usd

# A value of each kind a row's field can hold, and null (a fact not measured).
VALUES = {
    "num_gpus": [1, 2, 3, 8, None], "gpu_name": ["RTX A5000", "rtx_a5000", "NVIDIA H100 SXM", "RTX 4090", None],
    "dph_total": [0.1, 0.3, 0.30000000000000004, 1.0, 2.5, None], "geolocation": ["DE", "de", "SE", None],
    "verified": [True, False, None], "driver_version": ["535.104.05", "550.54", "garbage", None],
    "reliability": [0.9, 0.99, 1.0, None], "cpu_cores": [16, 32, 64, None],
}


def _value(rng: random.Random, field: str):
    """A condition's value as query.parse makes it: the field's values, a version as its number."""
    value = rng.choice([v for v in VALUES[field] if v is not None] + [None])
    if field == "driver_version":
        return query.version_number(value)
    return value


def test_matcher_answers_as_matches_for_every_operator():
    rng = random.Random(5)
    rows = [{field: rng.choice(values) for field, values in VALUES.items() if rng.random() < 0.9}
            for _ in range(300)]
    checked = 0
    for _ in range(400):
        conditions = []
        for _ in range(rng.randint(0, 3)):
            field = rng.choice(list(VALUES))
            kind = query.FIELDS[field]
            ops = ["eq", "neq", "in", "notin"] + ([] if kind in (str, bool) else ["gt", "gte", "lt", "lte"])
            op = rng.choice(ops)
            if op in ("in", "notin"):
                value = [_value(rng, field) for _ in range(rng.randint(0, 3))]
            else:
                value = _value(rng, field)
                if value is None and op in query.ORDERED_OPERATORS:
                    continue  # parse refuses it
            conditions.append(query.Condition(field, op, value))
        match = query.matcher(conditions)
        for row in rows:
            assert match(row) == query.matches(row, conditions), (row, conditions)
            checked += 1
    assert checked == 400 * 300


def test_usd_is_the_decimal_conversion_for_every_amount():
    rng = random.Random(11)
    amounts = [0, 1, 9, 10, 999_999, 1_000_000, 1_000_001, 300_000, 100_000 * 3, 1_504_000, 10**12 + 7, -5_000_001]
    amounts += [rng.randrange(-10**15, 10**15) for _ in range(20_000)]
    amounts += [rng.randrange(1, 10**7) * n for n in range(1, 9) for _ in range(500)]  # prices x GPU counts
    for micros in amounts:
        assert usd(micros) == float(micros_to_usd(micros)) == float(Decimal(micros) / 10**6), micros
    assert usd(100_000 * 3) == 0.3  # not 0.1 * 3
