"""Telemetry in process: the request log, instruments and registries."""
