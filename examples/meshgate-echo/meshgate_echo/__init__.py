"""An example meshgate backend plugin."""
