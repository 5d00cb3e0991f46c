"""A small shop: orders admitted with their shipping run in one transaction."""
