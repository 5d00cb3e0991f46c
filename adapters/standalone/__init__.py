"""The Standalone and Edge process: one process that admits, schedules and executes work on an
embedded store, with startup recovery at boot and no continuous recovery."""

from ql3.adapters.standalone.exclusive import AlreadyRunning, DatabaseLock
from ql3.adapters.standalone.runner import BootReport, RunnerSettings, StandaloneRunner
from ql3.adapters.standalone.steps import DueRetryStart, StandaloneCoordinator

__all__ = [
    "AlreadyRunning",
    "BootReport",
    "DatabaseLock",
    "DueRetryStart",
    "RunnerSettings",
    "StandaloneCoordinator",
    "StandaloneRunner",
]
