"""Registers the shared helpers (tests/helpers) as a plugin: their fixtures are visible to every test."""

pytest_plugins = ["tests.helpers"]
