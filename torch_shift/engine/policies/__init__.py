"""Switching policies behind one interface (base.py), one module per policy, built by name from a registry.

| name | module | options | deployment |
| --- | --- | --- | --- |
| "static" | static.py | none | one layout, or every replica on its own |
| "shift" | shift.py | `ShiftOptions` (the engine's shift_threshold) | SP x TP (paper 000) |
| "flying" | flying.py | `FlyingOptions` | DP replicas of one rank (paper 004) |
| "seesaw" | seesaw.py | `SeesawOptions` | PP replicas with a TP layout (paper 003) |
| "random" | stress.py | `RandomOptions` | any (a stress test) |

A policy's options come from the engine's `policy_config` dict, checked against the options' dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch_shift.engine.policies.base import Policy, SchedulerView, StepDecision
from torch_shift.engine.policies.flying import FlyingOptions, FlyingPolicy
from torch_shift.engine.policies.seesaw import SeesawOptions, SeesawPolicy
from torch_shift.engine.policies.shift import ShiftOptions, ShiftPolicy
from torch_shift.engine.policies.static import SingleGroupPolicy, StaticPolicy
from torch_shift.engine.policies.stress import RandomOptions, RandomPolicy
from torch_shift.parallel.layouts import Deployment


@dataclass(frozen=True)
class PolicySpec:
    cls: type[Policy]
    options: type | None  # the dataclass of its options; None: it takes none


POLICIES: dict[str, PolicySpec] = {
    "static": PolicySpec(StaticPolicy, None),
    "shift": PolicySpec(ShiftPolicy, ShiftOptions),
    "flying": PolicySpec(FlyingPolicy, FlyingOptions),
    "seesaw": PolicySpec(SeesawPolicy, SeesawOptions),
    "random": PolicySpec(RandomPolicy, RandomOptions),
}


def policy_options(name: str, config: dict[str, Any] | None) -> Any:
    """The options dataclass of policy `name` from a user's dict (ValueError for unknown keys)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    spec = POLICIES[name]
    config = dict(config or {})
    if spec.options is None:
        if config:
            raise ValueError(f"policy {name!r} takes no options, got {sorted(config)}")
        return None
    known = {f.name for f in dataclasses.fields(spec.options)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"policy {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(sorted(known))}")
    return spec.options(**config)


def build_policy(name: str | None, deployment: Deployment, options: Any = None) -> Policy:
    """Policy `name` (None: the deployment's own) for `deployment`, with its options (a dataclass from
    `policy_options`, or None for the defaults)."""
    name = name or deployment.default_policy
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    spec = POLICIES[name]
    if spec.cls is StaticPolicy and deployment.num_replicas == 1:
        return SingleGroupPolicy(deployment.layouts[0].name, deployment)
    if spec.options is None:
        return spec.cls(deployment)
    return spec.cls(deployment, options if options is not None else spec.options())


__all__ = ["POLICIES", "FlyingOptions", "FlyingPolicy", "Policy", "PolicySpec", "RandomOptions", "RandomPolicy",
           "SchedulerView", "SeesawOptions", "SeesawPolicy", "ShiftOptions", "ShiftPolicy", "SingleGroupPolicy",
           "StaticPolicy", "StepDecision", "build_policy", "policy_options"]
