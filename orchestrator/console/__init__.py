"""The operator's console: admin commands against a running orchestrator's HTTP API.

`commands` declares each command once (the admin route it calls, its arguments, how its answer
reads), `client` speaks the admin API with the admin token, `render` turns its answers into text
for a person, `cli` derives `python -m orchestrator`'s subcommands from the declarations. The
console never opens the database: it works against any server the operator can reach.
"""
