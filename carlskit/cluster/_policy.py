"""The restart rule every supervised service shares: :class:`RestartPolicy` (exponential backoff
with jitter, budgeted in seconds) and :class:`Backoff` (one service's failure streak under it)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable

from carlskit._checks import finite_float, positive_float


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How a failing service is restarted: exponential backoff with jitter, budgeted in seconds.

    The ``n``-th consecutive failure waits ``min(max_delay_seconds, initial_delay_seconds *
    multiplier ** (n - 1)) * (1 - jitter * U)``, ``U ~ Uniform[0, 1)``, before the next try (jitter
    keeps many workers that lost the same dependency from retrying in lockstep). Failures are given
    up once ``budget_seconds`` have passed since the first failure of the streak; a piece that runs
    ``healthy_after_seconds`` without failing (or reports progress) ends the streak.

    Defaults: retry for 10 minutes, at most 15 s apart; a worker replaced by its nanny (seconds to
    a minute) or a learner rebuilt from its checkpoint is waited for, not given up.
    """

    budget_seconds: float = 600.0
    initial_delay_seconds: float = 0.25
    max_delay_seconds: float = 15.0
    multiplier: float = 2.0
    jitter: float = 0.5
    healthy_after_seconds: float = 30.0

    def __post_init__(self) -> None:
        for field in ("budget_seconds", "initial_delay_seconds", "max_delay_seconds", "healthy_after_seconds"):
            positive_float(getattr(self, field), field)
        if positive_float(self.multiplier, "multiplier") < 1.0:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier!r}")
        if not 0.0 <= finite_float(self.jitter, "jitter") < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter!r}")
        if self.max_delay_seconds < self.initial_delay_seconds:
            raise ValueError(f"max_delay_seconds ({self.max_delay_seconds}) must be >= initial_delay_seconds "
                             f"({self.initial_delay_seconds})")

    def delay(self, failures: int, rng: random.Random) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (``failures >= 1``)."""
        exponent = min(max(failures - 1, 0), 64)  # no float overflow however long the streak
        base = min(self.max_delay_seconds, self.initial_delay_seconds * self.multiplier ** exponent)
        return base * (1.0 - self.jitter * rng.random())


def restart_policy(value: RestartPolicy | float | None, name: str = "restart_policy") -> RestartPolicy:
    """``value`` as a policy: a policy, a budget in seconds, or ``None`` for the defaults."""
    if value is None:
        return RestartPolicy()
    if isinstance(value, RestartPolicy):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a RestartPolicy or a budget in seconds, got {type(value).__name__}")
    return RestartPolicy(budget_seconds=positive_float(value, name))


class Backoff:
    """One service's failure streak under a :class:`RestartPolicy` (thread-safe).

    ``failure()`` records a failure and returns the delay before the next try, or ``None`` once the
    budget is spent (give up); ``success()`` ends the streak; ``ready()`` says whether the delay of
    the last failure has passed.
    """

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic,
                 seed: int | None = None) -> None:
        self.policy, self.clock = policy, clock
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.failures = 0  # in the current streak
        self.streak_started: float | None = None
        self.retry_at = 0.0

    def failure(self) -> float | None:
        with self._lock:
            now = self.clock()
            if self.streak_started is None:
                self.streak_started = now
            self.failures += 1
            if now - self.streak_started >= self.policy.budget_seconds:
                return None
            delay = self.policy.delay(self.failures, self._rng)
            self.retry_at = now + delay
            return delay

    def success(self) -> None:
        with self._lock:
            self.failures, self.streak_started, self.retry_at = 0, None, 0.0

    def ready(self) -> bool:
        return self.clock() >= self.retry_at

    def seconds_left(self) -> float:
        """Seconds of the budget left in the current streak (the whole budget when healthy)."""
        if self.streak_started is None:
            return self.policy.budget_seconds
        return max(self.policy.budget_seconds - (self.clock() - self.streak_started), 0.0)
