"""The workflow tests run on every store: the contract suite's ``store`` and ``advance``."""

from tests.contract.conftest import advance, store

__all__ = ["advance", "store"]
