"""``bigbatch.hf``: the transformers adapter (``bigbatch.integrations.hf``, and its audit in
``bigbatch.integrations._hf_audit``), by its short name."""

from bigbatch.integrations._hf_audit import audit
from bigbatch.integrations.hf import Trainer, exact

__all__ = ["Trainer", "audit", "exact"]
