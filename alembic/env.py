"""Alembic environment of the rivet state schema.

statetool drives alembic programmatically (statetool/migrations.py): the caller opens
the connection and the transaction, and passes them in ``config.attributes``; this file
only configures the context. The version table is ``statetool.schema.VERSION_TABLE`` on
every path (online, offline ``--sql``, stamping, downgrade), never ``alembic_version``
(SPEC §10). This file runs from ``statetool/_alembic`` in the wheel and from ``alembic/``
in a checkout; both import the installed ``statetool`` package.
"""

from alembic import context

from statetool.schema import VERSION_TABLE

config = context.config
schema = config.attributes.get("schema")

if context.is_offline_mode():
    context.configure(
        dialect_name=config.attributes["dialect_name"],
        literal_binds=True,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        transactional_ddl=True,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        if schema:
            context.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            context.execute(f'SET LOCAL search_path TO "{schema}"')
        context.run_migrations()
elif "connection" in config.attributes:
    context.configure(
        connection=config.attributes["connection"],
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        transaction_per_migration=False,
        on_version_apply=config.attributes.get("on_version_apply"),
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    # The plain alembic CLI (alembic -c alembic.ini current), for a DBA: the URL comes
    # from sqlalchemy.url; ``-x schema=NAME`` selects a PostgreSQL state schema.
    from sqlalchemy import create_engine

    schema = context.get_x_argument(as_dictionary=True).get("schema")
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        context.configure(connection=connection, version_table=VERSION_TABLE, version_table_schema=schema)
        with context.begin_transaction():
            context.run_migrations()
