"""Deprecated: the former home of what each `k3` subcommand does, now one module per command (k3.cli.train,
k3.cli.generate, ...). Kept for `_train_config` alone, the name tests/training import: `k3.cli.train.train_config`
under its former name. Remove this module once nothing imports it."""

from __future__ import annotations

from .train import train_config as _train_config

__all__ = ["_train_config"]
