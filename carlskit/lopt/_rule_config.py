"""Rules as JSON: ``rule_to_config`` / ``rule_from_config`` over every built-in rule kind.

Below the rule modules (``_rules.py``, ``_nominal.py``) so that each can be imported alone; the
``.npz`` files of :mod:`carlskit.lopt._io` and the learner's checkpoints store this config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from carlskit.lopt._nominal import NominalAdamRule
from carlskit.lopt._protocols import UpdateRule
from carlskit.lopt._rules import HierarchicalRule, LearnableAdamRule, MLPUpdateRule

RULE_KINDS: dict[str, type] = {rule.kind: rule for rule in (MLPUpdateRule, LearnableAdamRule, HierarchicalRule,
                                                             NominalAdamRule)}


def rule_to_config(rule: UpdateRule) -> dict[str, Any]:
    """JSON-able description of a rule (``kind`` plus its dataclass fields)."""
    fields = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)}
    return {"kind": rule.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}


def rule_from_config(config: dict[str, Any]) -> Any:
    """The rule ``rule_to_config`` described; ValueError naming ``config['kind']`` for an unknown kind
    (the rule's own checks name a bad field)."""
    config = dict(config)
    kind = config.pop("kind", None)
    if kind not in RULE_KINDS:
        raise ValueError(f"config['kind'] must be one of {sorted(RULE_KINDS)}, got {kind!r}")
    return RULE_KINDS[kind](**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
