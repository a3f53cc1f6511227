"""The verifier: is accumulation exact for *this* model and loss, and if not, why not."""

from bigbatch.verifier._check import CheckReport, Diagnosis, NotExactError, check

__all__ = ["CheckReport", "Diagnosis", "NotExactError", "check"]
