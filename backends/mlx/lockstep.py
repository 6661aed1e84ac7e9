"""The head-to-follower wire of a distributed MLX runner: small int32 all-sums over the ring group.

Rank 0 (the head) serves HTTP and decides; followers contribute zeros and read the head's values. Every call on
the head is matched by exactly one call on each follower, in this order per generation::

    head: start(tokens)  step(t1) ... step(tn)  stop()         ...  shutdown()
    each: wait_start()   wait_step() ...        wait_step()->None   wait_start()->None, then barrier

between which both sides run the same forward passes (tensor-parallel layers hold their own collectives). With
no group (one process) every call is a no-op. A peer that never answers blocks forever: the launcher bounds runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Lockstep"]

_START, _SHUTDOWN = 1, 2


class Lockstep:
    """Head/follower commands over ``group`` (``None``: a single process, nothing to send)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1

    def _sum(self, values: list[int]) -> list[int]:
        import mlx.core as mx

        mine = mx.array(values if self.rank == 0 else [0] * len(values), dtype=mx.int32)
        out = mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out.tolist()

    # the head's side
    def start(self, tokens: list[int]) -> None:
        if self.group is not None:
            self._sum([_START, len(tokens)])
            self._sum(tokens)

    def step(self, token: int) -> None:
        if self.group is not None:
            self._sum([1, token])

    def stop(self) -> None:
        if self.group is not None:
            self._sum([0, 0])

    def shutdown(self) -> None:
        if self.group is not None:
            self._sum([_SHUTDOWN, 0])
            self.barrier()

    # a follower's side
    def wait_start(self) -> list[int] | None:
        """The next prompt, or ``None`` (after the closing barrier) when the head shuts down."""
        command, length = self._sum([0, 0])
        if command == _SHUTDOWN:
            self.barrier()
            return None
        return self._sum([0] * length)

    def wait_step(self) -> int | None:
        """The head's next token, or ``None`` when this generation is over."""
        more, token = self._sum([0, 0])
        return token if more else None

    def barrier(self) -> None:
        """Drain local work, then one scalar all-sum: no rank exits while a peer still has a transfer pending."""
        import mlx.core as mx

        mx.synchronize()
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group, stream=mx.cpu))
