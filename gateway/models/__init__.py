"""Ollama's model administration (show, ps, copy, delete, create, pull, keep-alive) over the dispatcher."""
