"""The port contract suite: one set of tests, run against every store."""
