"""The benchmarks of `care`; each runs from the repository root as ``python -m benchmarks.<name> --help``.

Shared pieces live in :mod:`benchmarks.common` (arguments, results files, tables, timing), the synthetic-world
helpers of the demo benchmarks in :mod:`benchmarks.demo_world` and every family's full-size random-weight model (from
the family records) in :mod:`benchmarks.models`.
"""
