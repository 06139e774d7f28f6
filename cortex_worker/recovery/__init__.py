"""Recovery from Cortex's own state: liveness (heartbeats), owners, the reconciler."""
