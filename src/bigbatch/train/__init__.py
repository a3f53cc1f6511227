"""The trainer: tasks, settings, the loop, resume files, logs and the report."""
