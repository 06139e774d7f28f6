"""Jobs: the record, options and kinds, the one lifecycle, children, approvals, feeds, and the agent loop (`turns/`)."""
