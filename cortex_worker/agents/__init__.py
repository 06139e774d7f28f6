"""Agents: `kind: Agent` manifests (`spec`), the prompts their models read (`prompt`, `text`)
and `type="agent"` actions run as child jobs (`action`).

Kept import-free: the action types (`actions.types`) read `text`, and `spec` reads their table.
"""
