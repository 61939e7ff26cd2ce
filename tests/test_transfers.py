"""``carlskit._transfers.steady_state``: the hot loops' transfer guard is on only when asked for,
and only after a loop's first step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from carlskit._transfers import ENVIRONMENT_VARIABLE, steady_state


def add_one(x):
    return jax.jit(lambda y: y + 1)(x)


def test_unset_it_guards_nothing(monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    with steady_state():
        assert add_one(np.zeros(2)).shape == (2,)  # an implicit transfer, allowed


def test_set_it_guards_warm_steps_and_lets_explicit_transfers_pass(monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "disallow")
    with steady_state(warm=False):
        add_one(np.zeros(2))
    with steady_state():
        assert jax.device_get(add_one(jax.device_put(np.zeros(2)))).tolist() == [1.0, 1.0]
        with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
            add_one(np.zeros(2))
