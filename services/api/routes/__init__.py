"""The orchestrator's REST API, one router per resource; ``services/api/app.py`` only wires them
into the app (lifespan, error handlers, the body limit, the OpenAPI additions)."""
