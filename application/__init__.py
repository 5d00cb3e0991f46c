"""Use cases and ports of the QL3 runtime. Depends on ``domain`` and the standard library only."""
