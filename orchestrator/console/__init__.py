"""The operator's console: admin commands against a running orchestrator's HTTP API.

`client` speaks the admin API with the admin token, `render` turns its answers into text for a
person, `commands` wires both into `python -m orchestrator`. The console never opens the
database: it works against any server the operator can reach.
"""
