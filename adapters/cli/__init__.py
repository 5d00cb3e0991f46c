"""The ``ql3`` command line."""
