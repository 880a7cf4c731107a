"""The topology's CLI flags, derived from its one declaration (`planner_service.topology.FIELDS`).

    add_topology_arguments(parser, defaults={"world_size": 1})   # --world-size, --microbatch-tokens, ...
    topology_from_args(args)      -> harts.v1.Topology   (`harts serve`: the default topology)
    plan_kwargs_from_args(args)   -> PlanConfig keyword arguments (`harts plan`)

Every field but the JSON documents (`--model`, `--cost-model` take a path or a name, which each
command resolves) becomes `--name-with-dashes`: a `no_` field a switch, the others with their
type, choices and default. A flag holds the PlanConfig value (an explicit 0 is passed on for
PlanConfig to judge); a default of None is the field's own default.
"""
from __future__ import annotations

import argparse
from typing import Any

from planner_service.topology import FIELDS
from proto.harts.v1 import planner_pb2

__all__ = ["add_topology_arguments", "topology_from_args", "plan_kwargs_from_args"]


def add_topology_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                           defaults: dict[str, Any] | None = None, help: dict[str, str] | None = None) -> None:
    """Add one flag per (non-document) topology field.

    Args:
        defaults: a command's own defaults by field name (else the declared PlanConfig default).
        help: a command's own help texts by field name (else the declared one).
    """
    defaults, help = defaults or {}, help or {}
    for f in FIELDS:
        if f.document:
            continue
        text = help.get(f.name) or f.help[0].lower() + f.help[1:]
        if f.type is bool:
            parser.add_argument(f.flag, action="store_true", help=text)
            continue
        default = defaults.get(f.name, f.default)
        if f.name not in help and default is not None:
            text += f" (0: {f.unset})" if default == f.type() and f.unset else f" (default {default})"
        extra: dict[str, Any] = {"metavar": f.metavar} if f.metavar else {}
        parser.add_argument(f.flag, type=f.type, default=default, choices=f.choices or None, help=text, **extra)


def topology_from_args(args: argparse.Namespace) -> planner_pb2.Topology:
    """The harts.v1.Topology the flags name (a flag left at None: the field unset)."""
    values = {f.name: getattr(args, f.name) for f in FIELDS if not f.document}
    return planner_pb2.Topology(**{name: v for name, v in values.items() if v is not None})


def plan_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """PlanConfig keyword arguments of the flags (a flag left at None: the field's default)."""
    out = {}
    for f in FIELDS:
        if f.document:
            continue
        value = getattr(args, f.name)
        out[f.plan_field] = f.default if value is None else (not value if f.negated else value)
    return out
