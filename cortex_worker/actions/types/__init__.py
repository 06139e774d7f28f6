"""One module per action type: everything that differs between `tool`, `llm`, `agent`,
`relic`, `workflow` and `internal` actions. `actions.table` lists them; `base` says what a
type declares."""
