"""The repository's scripts; each runs from the repository root as ``python -m scripts.<name>``."""
