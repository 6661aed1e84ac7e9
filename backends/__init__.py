"""Runtimes that turn an internal request into internal events. Imports protocols only; never the gateway,
the plugin layer or a web framework."""
