"""Older SDK generations, each in its own virtual environment (made on first use, cached in .cache/venvs)."""
