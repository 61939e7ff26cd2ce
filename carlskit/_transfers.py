"""The transfer guard of the hot loops: their steady-state steps move nothing between host and
device except what they move on purpose.

On an accelerator every implicit transfer inside a step is a synchronisation the step waits for
(a NumPy batch handed to a jitted function, ``float()`` of a device array, a Python int folded into
a key). ``jax.transfer_guard`` catches them on CPU too, but set globally (``JAX_TRANSFER_GUARD``)
it also fires on set-up, compilation, checkpoints and evaluations, where transfers are expected.

With the environment variable ``CARLSKIT_TRANSFER_GUARD`` set to a ``jax.transfer_guard`` level
(``"log"`` or ``"disallow"``), ``Trainer.fit`` (hence ``MoEModel.fit`` and ``TranslationModel.fit``),
its input pipeline, ``TranslationModel.generate`` and ``LearnedOptimizer.meta_train`` run every
step after their first (which compiles) under that level. The intended transfers are explicit and
stay allowed: the batch in (``jax.device_put``) and the scalars the history and display need
(``jax.device_get``). Unset (the default), the loops pay nothing.

On CPU the guard catches host-to-device and device-to-device transfers (several simulated devices);
reading a CPU array (``float(x)``, ``np.asarray(x)``) moves nothing there, so device-to-host ones
fire only on an accelerator: the loops make those explicit all the same.
"""

from __future__ import annotations

import contextlib
import os
from typing import ContextManager

import jax

ENVIRONMENT_VARIABLE = "CARLSKIT_TRANSFER_GUARD"


def steady_state(warm: bool = True) -> ContextManager:
    """``jax.transfer_guard(level)`` for a steady-state step (``warm``: not the loop's first step)
    when ``CARLSKIT_TRANSFER_GUARD`` names a level; otherwise a context that does nothing."""
    level = os.environ.get(ENVIRONMENT_VARIABLE)  # read per step: cheap, and a test can set it
    if not warm or not level:
        return contextlib.nullcontext()
    return jax.transfer_guard(level)
