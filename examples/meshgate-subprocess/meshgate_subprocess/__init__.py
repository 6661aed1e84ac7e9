"""An example meshgate backend plugin whose model runs out of process, on meshgate's runner seam.

``plugin`` is the gateway's side (hooks, backend, model source); ``runner`` is the runner process's side (the
engine and its ``main``). The two meet only over HTTP, so ``plugin`` never imports ``runner``.
"""
