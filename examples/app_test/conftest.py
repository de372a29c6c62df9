"""An application's conftest: the plugin gives each test a migrated cluster schema."""

pytest_plugins = ["cronoq_store.testing.pytest_plugin"]
