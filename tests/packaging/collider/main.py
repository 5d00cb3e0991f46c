"""Submit three orders to a Standalone runtime on a SQLite file, run them, print the outputs."""

import json
import sys

from application.checkout import checkout
from bootstrap.app import standalone
from domain.orders import Order


def main(path: str) -> None:
    runtime = standalone(path)
    try:
        run_ids = [checkout(runtime, Order(id=n, items=n + 1)) for n in range(3)]
        runtime.start()
        infos = [runtime.wait(run_id, timeout=60) for run_id in run_ids]
        print(json.dumps([{"status": i.status.value, "output": i.output} for i in infos]))
    finally:
        runtime.close()


if __name__ == "__main__":
    main(sys.argv[1])
