"""The gateway process: the Litestar app, the runtime it shares with a node agent, the routes and ``/ui``."""
