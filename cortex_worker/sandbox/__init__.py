"""Running untrusted code: `process` (subprocess sandbox), `runner` and `snippet` (entry points).

Kept import-free on purpose: `python -m cortex_worker.sandbox.function_main` must start fast.
Import from the submodules: `from cortex_worker.sandbox.process import run_sandboxed`.
"""
