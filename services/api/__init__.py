"""The REST API: the app factory (app.py), its dependencies, schemas, tokens, rate limits, routes."""
