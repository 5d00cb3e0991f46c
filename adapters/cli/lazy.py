"""A command group whose commands live in other modules, imported when one of them is named."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click


class LazyGroup(click.Group):
    """``lazy`` maps a command's name to ``"module:attribute"``; the module is imported when the
    command is run, asked for help, or listed (``--help`` of the group)."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = self._lazy.pop(cmd_name, None)
        if spec is not None:
            module, _, attribute = spec.partition(":")
            command = getattr(importlib.import_module(module), attribute)
            if not isinstance(command, click.Command) or command.name != cmd_name:
                raise RuntimeError(f"{spec} is not the command {cmd_name!r}")
            self.add_command(command)
        return super().get_command(ctx, cmd_name)
