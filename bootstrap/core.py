"""Providers every profile shares: admission, triggers, workflows, the worker protocol and the
inner scheduler (trigger schedule -> workflow frontier -> task attempt admission).

A profile container extends :class:`RuntimeCoreContainer` and provides ``store``."""

from __future__ import annotations

from dependency_injector import containers, providers

from ql3.adapters.cron import CroniterCalendar
from ql3.application.admission import Admission
from ql3.application.dispatch import DispatchGateStep
from ql3.application.identities import RandomIdentities
from ql3.application.ports import SchedulerStore
from ql3.application.scheduler import SchedulerCoordinator
from ql3.application.triggers import Triggers, TriggerSchedule
from ql3.application.worker_commands import WorkerCommands
from ql3.application.workflows import WorkflowFrontier, Workflows

DEFAULTS: dict[str, object] = {
    "lease_ttl_s": 30.0,
    "cadence_s": 1.0,
    "trigger_page_size": 16,
    "workflow_page_size": 16,
}


def seconds_to_ms(seconds: float) -> int:
    return max(1, round(float(seconds) * 1000))


class RuntimeCoreContainer(containers.DeclarativeContainer):
    config = providers.Configuration()
    store: providers.Dependency[SchedulerStore] = providers.Dependency()

    identities = providers.Singleton(RandomIdentities)
    lease_ttl_ms = providers.Callable(seconds_to_ms, config.lease_ttl_s)

    admission = providers.Singleton(
        Admission, uow_factory=store.provided.unit_of_work, identities=identities
    )
    worker_commands = providers.Singleton(
        WorkerCommands,
        uow_factory=store.provided.unit_of_work,
        identities=identities,
        lease_ttl_ms=lease_ttl_ms,
    )

    cron_calendar = providers.Singleton(CroniterCalendar)
    triggers = providers.Singleton(
        Triggers,
        uow_factory=store.provided.unit_of_work,
        identities=identities,
        calendar=cron_calendar,
    )
    workflows = providers.Singleton(
        Workflows, uow_factory=store.provided.unit_of_work, identities=identities
    )

    trigger_schedule = providers.Singleton(
        TriggerSchedule,
        uow_factory=store.provided.unit_of_work,
        source=store,
        calendar=cron_calendar,
        identities=identities,
        page_size=config.trigger_page_size,
    )
    workflow_frontier = providers.Singleton(
        WorkflowFrontier,
        uow_factory=store.provided.unit_of_work,
        source=store,
        identities=identities,
        page_size=config.workflow_page_size,
    )
    dispatch_gate = providers.Singleton(
        DispatchGateStep, uow_factory=store.provided.unit_of_work, source=store
    )
    scheduler = providers.Singleton(
        SchedulerCoordinator,
        trigger_schedule=trigger_schedule,
        workflow_frontier=workflow_frontier,
        task_attempt_admission=dispatch_gate,
    )
