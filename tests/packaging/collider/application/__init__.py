"""The application's own use cases."""
