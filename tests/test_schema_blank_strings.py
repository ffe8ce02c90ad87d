"""A string field that allows "" is published as oneOf(its own rules, maxLength 0). When its own rules also accept ""
(a pattern like ^(acct_...)?$), "" matches both branches and oneOf rejects it: the schema then calls a request the
API accepts invalid (schemathesis found PATCH /api/v1/billing/profile/ with stripe_connect_account_id "" answered
200 where the schema said 4xx)."""
import re
from pathlib import Path

import yaml

SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml"


def _accepts_blank(branch: dict) -> bool:
    if branch.get("type") != "string" or branch.get("minLength", 0) > 0:
        return False
    if "enum" in branch and "" not in branch["enum"]:
        return False
    return "pattern" not in branch or re.search(branch["pattern"], "") is not None


def _blank_both_ways(node, path="", found=None):
    found = [] if found is None else found
    if isinstance(node, dict):
        branches = node.get("oneOf")
        if isinstance(branches, list) and any(isinstance(b, dict) and b.get("maxLength") == 0 for b in branches):
            if sum(_accepts_blank(b) or b.get("maxLength") == 0 for b in branches if isinstance(b, dict)) > 1:
                found.append(path)
        for key, value in node.items():
            _blank_both_ways(value, f"{path}/{key}", found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _blank_both_ways(value, f"{path}[{i}]", found)
    return found


def test_no_blank_string_matches_two_branches_of_a_oneof():
    assert _blank_both_ways(yaml.safe_load(SCHEMA.read_text())) == []


def test_the_check_would_tell():
    schema = {"a": {"oneOf": [{"type": "string", "pattern": "^(acct_x)?$"}, {"type": "string", "maxLength": 0}]},
              "b": {"oneOf": [{"type": "string", "pattern": "^acct_x$"}, {"type": "string", "maxLength": 0}]}}
    assert _blank_both_ways(schema) == ["/a"]
