"""The HTTP layer: binding and auth at start-up, coalesced streaming."""
