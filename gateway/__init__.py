"""The server and the control plane. May import everything; nothing imports it."""
