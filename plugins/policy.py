"""The built-in backend choice: the first registered backend that supports the model.

Published as the ``default_policy`` entry point; it runs last, so any other plugin's choice wins.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.base import Backend, ModelCard
from plugins.hookspecs import hookimpl


@hookimpl(trylast=True)
def meshgate_choose_backend(card: ModelCard, backends: Sequence[Backend]) -> Backend | None:
    return next((b for b in backends if b.supports(card)), None)
