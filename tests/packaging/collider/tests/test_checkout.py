from pathlib import Path

from adapters.tasks import tasks
from application.checkout import checkout
from domain.orders import Order

import domain
import ql3
import ql3.domain


def test_the_application_keeps_its_own_packages() -> None:
    assert Path(domain.__file__).parents[1] == Path(__file__).parents[1]
    assert ql3.domain.__name__ == "ql3.domain"  # QL3's layer lives under its own root


def test_a_charge_runs_on_the_in_memory_runtime() -> None:
    runtime = ql3.testing.in_memory(tasks)
    run_id = checkout(runtime, Order(id=7, items=4))
    assert runtime.run_due() == 1
    info = runtime.get(run_id)
    assert info.succeeded and info.output == {"order": 7, "cents": 1000}


def test_a_refusal_is_a_ql3_error() -> None:
    runtime = ql3.testing.in_memory(tasks)
    try:
        runtime.submit("charge", {"id": 1, "items": 1}, priority=10**9)
    except ql3.Error as error:
        assert "priority" in str(error)
    else:
        raise AssertionError("an out-of-range priority was admitted")
