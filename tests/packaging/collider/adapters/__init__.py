"""The application's own adapters: its task code."""
