"""The benchmarks and studies, each run from the repository root as `python -m benchmarks.NAME`
(docs/benchmarks.md). Product code never imports them (tests/test_import_rules.py)."""
