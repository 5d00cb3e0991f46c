"""SQLAlchemy Core schema and row mapping shared by the SQL stores."""
