"""quiet_transformers: silences transformers and huggingface_hub for a block, nested blocks cost nothing and undo
nothing of the outer one, and the caller's settings come back."""

from __future__ import annotations

import logging
import warnings

from transformers.utils import logging as hf_logging

from care_core.backbones._hf import quiet_transformers


def test_a_nested_block_keeps_the_outer_silence_and_the_callers_settings_come_back() -> None:
    hub = logging.getLogger("huggingface_hub")
    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), hub.level)
    hf_logging.set_verbosity_info()
    hub.setLevel(logging.DEBUG)
    try:
        with quiet_transformers():
            with quiet_transformers():
                assert hf_logging.get_verbosity() == logging.ERROR
            # the inner exit restored nothing: still silent
            assert hf_logging.get_verbosity() == logging.ERROR and not hf_logging.is_progress_bar_enabled()
            assert hub.level == logging.ERROR
        assert hf_logging.get_verbosity() == logging.INFO and hub.level == logging.DEBUG
    finally:
        hf_logging.set_verbosity(before[0])
        if before[1]:
            hf_logging.enable_progress_bar()
        hub.setLevel(before[2])


def test_warnings_inside_a_nested_block_are_silenced() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_transformers(), quiet_transformers():
            warnings.warn("noise", UserWarning, stacklevel=1)
        warnings.warn("after", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["after"]
