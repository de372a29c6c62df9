"""PgHost: one process leading many cluster schemas"""
