"""API keys (``keys``: stored hashed, scopes, limits) and the one guard on every route (``guard``)."""
