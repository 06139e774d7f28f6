"""Action types: the one table that says how each type is checked, routed, timed and run."""
