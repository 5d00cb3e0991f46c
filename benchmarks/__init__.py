"""Benchmarks of the QL3 runtime, each beside its reference measured in the same run.

``python -m benchmarks recovery`` times runtime recovery against pgbench TPC-B at as many clients
as recovery's transactions at once, and at one client;
``python -m benchmarks idle`` measures one idle Cluster cycle on an empty and on a large
database; ``python -m benchmarks recover-time`` times recovery after the SIGKILL of a worker;
``python -m benchmarks throughput`` works no-op runs through one node and one worker against
PgQueuer, and ``python -m benchmarks latency`` times a submit to the first line of its task
against PgQueuer, both with real ``ql3 serve`` and ``ql3 worker`` processes;
``python -m benchmarks standalone`` works no-op runs through ``ql3 standalone`` against Huey's
``SqliteHuey``; ``python -m benchmarks chaos`` applies faults (kills, server restarts, held
transactions, exhausted connections) under a fixed load to QL3, PgQueuer and Procrastinate on a
private server. Each prints a table and, with ``--json``, one JSON object as its last line.
"""
