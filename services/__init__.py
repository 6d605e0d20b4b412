"""The orchestrator: ingest, health, persistence, REST API and metrics."""
