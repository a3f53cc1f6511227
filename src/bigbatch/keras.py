"""``bigbatch.keras``: the Keras 3 adapter (``bigbatch.integrations.keras``), by its short name."""

from bigbatch.integrations.keras import Accumulation, StepInfo, accumulate

__all__ = ["Accumulation", "StepInfo", "accumulate"]
