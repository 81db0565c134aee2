"""Typed failures of the fleet adapters; the CLI shows them as one line."""

from __future__ import annotations


class FleetError(Exception):
    """A fleet operation could not be done (unknown group, bad request, cloud API error)."""


class FleetEventError(ValueError):
    """A cloud event is not one the adapter understands (wrong type, missing fields)."""
