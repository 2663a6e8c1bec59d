"""Small helpers around `transformers` shared by the adapters, the loader and the demo builders."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers / huggingface_hub warnings, info logs and progress bars, then restore them.

    The library never prints; what transformers would log (processor fallbacks without
    torchvision, generation-config notes, "Loading weights" bars) is noise for our users.
    """
    from transformers.utils import logging as hf_logging

    if _already_quiet(hf_logging):  # nested (a data-set run wraps its loop): setting levels again clears caches
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = hf_logging.get_verbosity()
        bars = hf_logging.is_progress_bar_enabled()
        hub_logger = logging.getLogger("huggingface_hub")
        hub_level = hub_logger.level
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        hub_logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
            hub_logger.setLevel(hub_level)


def _already_quiet(hf_logging: Any) -> bool:
    """Whether an enclosing :func:`quiet_transformers` (or the user) already silences all it would."""
    ignore_all = bool(warnings.filters) and warnings.filters[0][0] == "ignore" and warnings.filters[0][1] is None
    ignore_all = ignore_all and warnings.filters[0][2] is Warning and warnings.filters[0][3] is None
    return (ignore_all and hf_logging.get_verbosity() >= logging.ERROR and not hf_logging.is_progress_bar_enabled()
            and logging.getLogger("huggingface_hub").level >= logging.ERROR)  # fmt: skip
