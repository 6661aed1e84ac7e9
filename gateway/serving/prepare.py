"""What a request becomes before it is routed, as one pure function: ``prepare``.

In this order, each step reading what the one before wrote:

1. **Output cap.** ``max_tokens`` above the gateway's limit (``MESHGATE_MAX_TOKENS``) is refused with the
   protocol's 400, or cut to it where the protocol clamps (Ollama's ``num_predict``) (``context_fit.cap_output``).
2. **Model defaults.** A user model's stored parameters and system prompt (Ollama Modelfile) fill what the request
   left unset (``model_defaults.apply_defaults``).
3. **Capabilities.** Tools, images, structured output and raw prompts the backend cannot serve for this model are
   refused with a 400 naming the field (``backends.base.check_capabilities``).
4. **Default stops.** Whether a stop that the model's defaults added (not the client) ends the turn as the model's
   own end of turn would (``Prepared.defaults_end_turn``; ``model_defaults.end_turn_at_default_stops``).

What cannot be known before a replica is chosen comes after, in the dispatcher: the context fit needs the chosen
replica's context and its tokenizer's count (``context_fit.fit_context``), and then the output is capped again to
the room that context leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshgate.backends.base import Capabilities, check_capabilities
from meshgate.backends.registry import UserModel
from meshgate.gateway.serving.context_fit import cap_output
from meshgate.gateway.serving.model_defaults import apply_defaults
from meshgate.protocols.model import Request

__all__ = ["Prepared", "prepare"]


@dataclass(frozen=True)
class Prepared:
    request: Request
    """What is routed and sent to the runner."""
    asked: Request
    """The request as the client asked it, after the output cap (for the default-stops rule)."""
    context: int | None
    """The context the request asks for (Ollama's ``num_ctx``, the client's or its model's): routing picks a
    replica that holds it; ``None``: any."""

    @property
    def defaults_end_turn(self) -> bool:
        """A stop the model's defaults added (the client set none) ends the turn as a plain end of turn."""
        return not self.asked.stop and bool(self.request.stop)


def prepare(
    request: Request,
    *,
    model: str,
    user_model: UserModel | None,
    capabilities: Capabilities,
    max_tokens: int,
    clamp_output: bool,
) -> Prepared:
    """``request`` for ``model`` made ready to route (module docstring: cap, defaults, capabilities, stops).

    Raises:
        OutputTooLarge: ``max_tokens`` above ``max_tokens`` where the protocol does not ``clamp_output``.
        UnsupportedFeature: the request asks for what ``capabilities`` lack.
    """
    asked = cap_output(request, max_tokens, clamp=clamp_output)
    sent = apply_defaults(asked, user_model)
    check_capabilities(sent, capabilities, model)
    return Prepared(request=sent, asked=asked, context=sent.num_ctx if isinstance(sent.num_ctx, int) else None)
