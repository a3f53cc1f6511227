"""Memory: out-of-memory recognition, micro-batch sizing, peak measurement, checkpointing, planning."""
