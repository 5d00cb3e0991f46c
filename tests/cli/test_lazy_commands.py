"""Commands defined in modules of their own load when named (ADR 0009), and every one of them
is there: listed by ``--help``, with its own help, under the name the group gives it."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from ql3.adapters.cli.lazy import LazyGroup
from ql3.adapters.cli.main import cli, main

LAZY_GROUPS = {
    "": {
        "credentials",
        "doctor",
        "serve",
        "standalone",
        "status",
        "tasks",
        "triggers",
        "worker",
        "workers",
        "workflows",
    },
    "db": {"grant-ingress"},
    "runs": {"quarantine", "unquarantine"},
}
OWN = {"": {"attempts", "db", "demo", "runs", "scheduler", "submit"}, "db": {"upgrade"}}


def _group(path: str) -> click.Group:
    group = cli if not path else cli.commands[path]
    assert isinstance(group, click.Group)
    return group


@pytest.mark.parametrize("path", sorted(LAZY_GROUPS))
def test_every_command_of_a_group_is_listed_and_loads_under_its_name(path: str) -> None:
    group = _group(path)
    context = click.Context(group)
    names = set(group.list_commands(context))
    assert LAZY_GROUPS[path] | OWN.get(path, set()) <= names
    for name in sorted(names):
        command = group.get_command(context, name)
        assert command is not None and command.name == name


@pytest.mark.parametrize(
    ("path", "name"), sorted((path, name) for path, names in LAZY_GROUPS.items() for name in names)
)
def test_a_lazy_command_answers_help_in_a_fresh_process(path: str, name: str) -> None:
    argv = [*([path] if path else []), name, "--help"]
    done = subprocess.run(
        [sys.executable, "-m", "ql3.adapters.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Usage: ql3 {' '.join(argv[:-1])} [OPTIONS]")


def test_the_top_level_help_lists_the_lazy_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line[:2] == "  "}
    assert LAZY_GROUPS[""] | OWN[""] <= listed


def test_a_spec_that_names_another_command_is_refused() -> None:
    group = LazyGroup(name="g", lazy={"submit-twice": "ql3.adapters.cli.main:submit"})
    with pytest.raises(RuntimeError, match="is not the command 'submit-twice'"):
        group.get_command(click.Context(group), "submit-twice")
