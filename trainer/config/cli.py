"""The trainer's command line: `--config FILE` and one `--section.field` flag per config field.

    p = argparse.ArgumentParser(); add_config_arguments(p)
    cfg = config_from_namespace(p.parse_args(["--config", "x.toml", "--job.steps", "4"]))
    cfg = load_config("x.toml", ["--objective.clip_high", "0.28"])      # the same, without a parser

Precedence: the dataclass defaults, then the file, then the flags, then the environment for the
planner URL and token (HARTS_PLANNER_URL, HARTS_TOKEN; only where neither file nor flag set them).
`--help` lists every field with its docstring and default; the short flags of earlier releases
(`--steps`, `--lr`, `--planner-url`, ...) remain aliases of their dotted fields.
"""
from __future__ import annotations

import argparse
import ast
import functools
import inspect
import os
import typing
from pathlib import Path

from trainer.config.loader import config_from_dict, read_config_file, to_dict, with_overrides
from trainer.config.schema import SECTIONS, TrainerConfig

__all__ = ["ALIASES", "add_config_arguments", "config_from_namespace", "load_config", "field_docs"]

#: Flags of earlier releases, kept as aliases of their dotted fields.
ALIASES: dict[str, str] = {
    "planner.url": "--planner-url", "planner.token": "--token", "planner.plan_timeout": "--plan-timeout",
    "planner.ready_timeout": "--ready-timeout", "job.steps": "--steps", "job.step_prefix": "--step-prefix",
    "job.step_ids": "--step-ids", "job.seed": "--seed", "model.name": "--model", "optimizer.lr": "--lr",
    "optimizer.weight_decay": "--weight-decay", "optimizer.max_grad_norm": "--max-grad-norm",
    "executor.backend": "--backend", "executor.chunk_size": "--chunk-size", "checkpoint.dir": "--checkpoint-dir",
    "checkpoint.every": "--checkpoint-every", "checkpoint.resume": "--resume", "checkpoint.keep_last": "--keep-last",
    "checkpoint.export_every": "--export-every", "metrics.jsonl": "--metrics-jsonl",
    "metrics.tensorboard_dir": "--tensorboard-dir", "parallelism.data_parallel": "--data-parallel",
}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source; "" where none)."""
    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            out[node.target.id] = " ".join(nxt.value.value.split())
    return out


def _metavar(hint) -> str:
    text = getattr(hint, "__name__", None) or str(hint)
    return text.replace("typing.", "").replace(" | None", "|none").upper()


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """`--config FILE` and one `--section.field` flag per leaf field (old flat flags as aliases).

    Every flag defaults to argparse.SUPPRESS: only what the command line sets overrides the file.
    """
    p.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                   help="TOML or YAML trainer config (see examples/); dotted flags below override it")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(f"{section}", (cls.__doc__ or "").strip().split("\n")[0])
        docs = field_docs(cls)
        defaults = to_dict(cls())
        for name, hint in typing.get_type_hints(cls).items():
            dest = f"{section}.{name}"
            flags = [f"--{dest}"] + ([ALIASES[dest]] if dest in ALIASES else [])
            default = defaults[name]
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            kw = dict(dest=dest, default=argparse.SUPPRESS, help=f"{docs.get(name, '')} (default: {shown})")
            if hint is bool:
                kw.update(nargs="?", const="true", metavar="BOOL")
            else:
                kw.update(metavar=_metavar(hint))
            group.add_argument(*flags, **kw)


def config_from_namespace(args: argparse.Namespace) -> TrainerConfig:
    """TrainerConfig of parsed arguments: defaults < --config file < flags < env (token and URL, only when unset)."""
    ns = vars(args)
    doc = read_config_file(ns["config"]) if ns.get("config") else {}
    flags = {dest: v for dest, v in ns.items() if "." in dest and dest.split(".", 1)[0] in SECTIONS}
    doc = with_overrides(doc, flags)
    planner = doc.setdefault("planner", {})
    if isinstance(planner, dict):
        if "url" not in planner and os.environ.get("HARTS_PLANNER_URL"):
            planner["url"] = os.environ["HARTS_PLANNER_URL"]
        if "token" not in planner and os.environ.get("HARTS_TOKEN"):
            planner["token"] = os.environ["HARTS_TOKEN"]
    return config_from_dict(doc, where=f"--config {ns['config']}" if ns.get("config") else "config")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainerConfig:
    """Defaults < file < dotted overrides (`["--objective.clip_high", "0.28"]`), as the CLI does."""
    p = argparse.ArgumentParser(add_help=False)
    add_config_arguments(p)
    args = p.parse_args([*(["--config", str(path)] if path else []), *(overrides or [])])
    return config_from_namespace(args)
