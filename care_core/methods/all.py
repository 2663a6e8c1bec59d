"""Imports every method module once, so that each registers itself (listing order = each class's ``rank``)."""

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
