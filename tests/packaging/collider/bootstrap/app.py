from adapters.tasks import tasks

import ql3


def standalone(path: str) -> ql3.StandaloneRuntime:
    return ql3.standalone(path, tasks=tasks)
