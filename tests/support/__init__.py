"""Factories for the real processes that tests run against (redis-server, HTTP servers)."""
