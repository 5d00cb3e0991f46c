"""The shop's tests run on QL3's in-memory runtime: its fixtures come from the plugin."""

import pytest

from shop.tasks import tasks

pytest_plugins = ["ql3.pytest_plugin"]


@pytest.fixture
def ql3_tasks():
    return tasks
