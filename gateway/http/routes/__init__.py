"""Thin HTTP handlers, one module per client protocol: decode, translate, dispatch, encode."""
