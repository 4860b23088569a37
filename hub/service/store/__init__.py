"""The jobs database: tables, sessions and their threads, migrations, the audit chain, the GPU ledger and
keyset listings. It knows no HTTP, no admission model and no backend.
"""
