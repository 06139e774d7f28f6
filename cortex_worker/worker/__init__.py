"""The worker process: its per-process steps and the fixes to kombu it runs with."""
