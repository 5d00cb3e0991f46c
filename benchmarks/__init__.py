"""Benchmarks of the QL3 runtime's Cluster profile against a real PostgreSQL server.

``python -m benchmarks recovery`` times runtime recovery against single-client pgbench TPC-B;
``python -m benchmarks idle`` measures one idle Cluster cycle on an empty and on a large
database. Each prints a table and, with ``--json``, one JSON object as its last line.
"""
