"""``bigbatch.lightning``: the Lightning adapter (``bigbatch.integrations.lightning``), by its short name."""

from bigbatch.integrations.lightning import Exact, audit

__all__ = ["Exact", "audit"]
