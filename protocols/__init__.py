"""Client wire protocols and the internal model they translate to (pure; no I/O, no web framework)."""
