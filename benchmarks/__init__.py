"""Benchmarks of the QL3 runtime's Cluster profile against a real PostgreSQL server.

``python -m benchmarks recovery`` times runtime recovery against single-client pgbench TPC-B;
``python -m benchmarks idle`` measures one idle Cluster cycle on an empty and on a large
database; ``python -m benchmarks recover-time`` times recovery after the SIGKILL of a worker and
``python -m benchmarks throughput`` no-op runs through one node and one worker against PgQueuer,
both with real ``ql3 serve`` and ``ql3 worker`` processes. Each prints a table and, with
``--json``, one JSON object as its last line.
"""
