"""Imports every method module once, so that each registers itself (order = listing order)."""

from care_core.methods import (  # noqa: F401
    care_family,
    divprune,
    fastv,
    ficoco,
    pool,
    prumerge,
    random_select,
    sparsevlm,
    tome,
    visionzip,
    zoo_prune,
)

LISTING_ORDER = (
    "care", "prca-only", "simple-calib", "confidence-calib", "prca+simple-calib", "zoo-prune",
    "divprune", "visionzip", "prumerge+", "prumerge", "tome", "ficoco-v", "fastv", "sparsevlm", "random", "pool",
)  # fmt: skip
