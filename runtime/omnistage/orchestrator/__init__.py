"""The per-pipeline orchestrator: request state, routing across stage pools, HTTP front door."""
