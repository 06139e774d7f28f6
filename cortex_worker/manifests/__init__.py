"""Manifests: every `kind:` loaded from a directory and linked into one `Registry`."""
