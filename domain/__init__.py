"""The QL3 runtime domain: entities, statuses and pure transitions.

Nothing in this package performs I/O or reads a clock. Time always arrives as ``now_ms``, observed
by the store (the database's ``statement_timestamp()`` in the Cluster profile).
"""
