"""``gpushare``: the command line for CI pipelines and people (see docs/ci.md)."""
