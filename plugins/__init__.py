"""The extension contract: pluggy hook specifications, the plugin manager, settings, the built-in plugins.

Imports backends and protocols; never the gateway.
"""
