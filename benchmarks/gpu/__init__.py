"""The GPU benchmark, split by subject; run it as ``python -m benchmarks.gpu`` (see ``benchmarks/gpu/__main__.py``).

``context`` (setting, workloads), ``scoring`` (the micro part), ``workload`` (methods and first token per K),
``generate`` (the user-facing generate path), ``report`` (tables and targets).
"""
