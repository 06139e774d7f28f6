"""Cortex's Redis: every key (`keys`), the `Store` and its Lua scripts (`lua/`), the chunk writer. Nothing else touches a Redis key."""
