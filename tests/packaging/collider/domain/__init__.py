"""The application's own domain: nothing of QL3's."""
