"""Composition roots, one per profile: ``cluster``, ``standalone``, ``edge``.

Nothing is built at import time: each module declares a container; callers build one with
``build(...)`` and own what it returns."""
