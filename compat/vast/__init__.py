"""A Vast.ai-compatible API under /compat/vast, so that the `vastai` CLI and SDK work unchanged (docs/vast-cli.md).

An adapter only: every request is translated into the same services and selectors /api/v1/ calls, and every
answer into the shapes the CLI reads. It holds no rule of its own and is kept out of the published schema.
"""
