"""The QL3 runtime test suite."""
