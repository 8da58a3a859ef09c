"""The registry tfdp.process_state keeps (issue 60): each module declares its own state at
import; reset() clears in the order the owners were imported. tests/test_process_state.py
proves reset() is complete; this file pins the registry's own rules."""

import sys

import pytest

import tfdp  # noqa: F401 (imports the modules that declare their state)
import tfdp.keras_distribution.backend  # noqa: F401 (declares "keras.distribution")
from tfdp import process_state


def test_the_patches_are_declared_before_the_keras_distribution_that_clears_after_them():
    # keras_distribution.backend's clear sets Keras's distribution back quietly, which needs
    # Keras's own functions: the patches must be restored first (backend imports _tf_private,
    # which declares them, so the import order guarantees it).
    names = [holder.name for holder in process_state.HOLDERS]
    assert names.index("patches") < names.index("keras.distribution")


def test_every_holder_names_its_owner_and_no_name_twice():
    holders = process_state.HOLDERS
    assert len({h.name for h in holders}) == len(holders)
    assert all(h.module in sys.modules for h in holders)
    assert process_state.describe().keys() >= {h.name for h in holders}


def test_a_second_owner_of_a_name_is_refused_and_the_owner_may_declare_again():
    owner = next(h for h in process_state.HOLDERS if h.name == "said once")
    with pytest.raises(ValueError, match="already declared by tfdp.said_once"):
        process_state.register("said once", "somewhere.else", lambda: 0, lambda: None)
    # A module reloaded declares again and replaces its entry (same name, same owner).
    again = process_state.register(owner.name, owner.module, owner.describe, owner.clear)
    try:
        assert [h for h in process_state.HOLDERS if h.name == "said once"] == [again]
    finally:
        process_state.register(owner.name, owner.module, owner.describe, owner.clear)
