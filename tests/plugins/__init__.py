"""The plugin contract, settings and backend choice."""
