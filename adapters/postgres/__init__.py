"""The Cluster profile's store on PostgreSQL: store, SQL statements and Alembic migrations."""
