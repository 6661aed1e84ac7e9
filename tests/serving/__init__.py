"""The serving path in process: queue and context rules, defaults, output caps, stops, the dispatcher."""
