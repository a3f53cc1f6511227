"""``bigbatch.hf``: the transformers adapter (``bigbatch.integrations.hf``), by its short name."""

from bigbatch.integrations.hf import Trainer, audit, exact

__all__ = ["Trainer", "audit", "exact"]
