"""The jobs database's schema history: an Alembic environment and its revisions.

Each file in ``versions/`` is one schema change, numbered (``0001``, ``0002``,
...) and written to upgrade and downgrade on SQLite and PostgreSQL alike.
``0001`` is the schema of Danlu 0.1.0, the last release without migrations.
:mod:`danlu.hub.service.store.schema` runs them (``danlu up`` upgrades, the jobs service
only checks). A schema change to :mod:`danlu.hub.service.store.orm` comes with a
new revision: generate a draft with ``alembic.command.revision(
db.alembic_config(URL), "what changed", autogenerate=True, rev_id="0003")`` on a
database at head, then read and complete it (server defaults for new NOT NULL
columns, the downgrade); ``tests/test_migrations.py`` fails until the migrated
schema equals the models.
"""
