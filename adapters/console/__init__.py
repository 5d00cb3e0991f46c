"""The operator console (ADR 0020): a web UI for operators, beside the CLI."""
