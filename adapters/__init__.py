"""Implementations of the application ports and the edges of the runtime.

``memory`` (reference store and fake clock), ``sql`` (shared schema, SQLite store), ``postgres``
(Cluster only), ``http``, ``worker`` and ``cli``. Nothing here is imported by ``domain`` or
``application``.
"""
