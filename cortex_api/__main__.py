"""`python -m cortex_api`: the `cortex` command."""

from cortex_api.cli import app

app(prog_name="cortex")
