"""Moved: the metadata servers are part of the local cluster now."""

from spotinfer.local.metadata_servers import *  # noqa: F403
