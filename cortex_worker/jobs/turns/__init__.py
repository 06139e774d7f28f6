"""The agent loop (protocol.md §5): one task per turn on the `agent` pool."""
