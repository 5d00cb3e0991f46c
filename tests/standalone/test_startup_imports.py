"""``ql3 standalone`` imports its profile's containers without the web frameworks that
dependency_injector would load because they are installed; task code can still import them."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_profile_loads_no_web_framework_and_task_code_still_can() -> None:
    script = textwrap.dedent(
        """
        import sys
        from ql3.adapters.cli.standalone_cmds import (
            UNUSED_INTEGRATIONS,
            _without_unused_integrations,
        )

        with _without_unused_integrations():
            from ql3.bootstrap import edge, standalone  # noqa: F401
        assert "dependency_injector.containers" in sys.modules
        loaded = [name for name in UNUSED_INTEGRATIONS if name in sys.modules]
        assert loaded == [], loaded
        import fastapi  # what a task may import: found again
        assert sys.modules["fastapi"] is fastapi
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_an_integration_already_imported_stays_as_it_was() -> None:
    script = textwrap.dedent(
        """
        import sys
        import starlette
        from ql3.adapters.cli.standalone_cmds import _without_unused_integrations

        with _without_unused_integrations():
            from ql3.bootstrap import standalone  # noqa: F401
        assert sys.modules["starlette"] is starlette
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
