"""Tools: `spec` (`kind: Tool` manifests and the built-ins' specs), `runtime` (running a call).

Kept import-free on purpose: the API reads `spec` without loading the tool implementations
(`builtin`, `sandboxed`, …) or the sandbox. Import from the submodules.
"""
