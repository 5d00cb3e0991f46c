"""The application's own composition root."""
