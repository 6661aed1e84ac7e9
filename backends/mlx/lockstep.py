"""The head-to-follower wire of a distributed MLX runner: small int32 all-sums over the ring group.

Rank 0 (the head) serves HTTP and decides; followers contribute zeros and read the head's values. The head's
scheduler sends each operation on the shared batch (``backends.mlx.batch.Batch``) before running it; every
follower receives it with ``receive`` and runs the same operation on its shard::

    head:     kv(...)    admit(tokens)  step(picks)  keep(rows)  ...  shutdown()
    follower: receive()  receive()      receive()    receive()   ...  receive() -> ("shutdown", []), barrier

between which both sides run the same forward passes (tensor-parallel layers hold their own collectives;
pipeline stages pass hidden states). A message is one all-sum of ``[op, n, v0 .. v7]``, the values inline when
there are at most eight (a decode step of up to eight rows), else followed by one all-sum of all ``n`` values (a
prompt). ``kv`` carries the KV tier's decision for a new sequence (``batch.Follower``: keep its prompt's cache,
restore an entry at a length); a restore is then put to a vote (``agree``), the one all-sum to which every rank
contributes its own answer, so that either every rank restores or every rank prefills. With no group (one
process) every call is a no-op. A peer that never answers blocks forever: the launcher bounds runs, and the head
watches its followers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Lockstep"]

_OPS = ("admit", "keep", "step", "shutdown", "kv")
_INLINE = 8


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
    def send(self, op: str, values: list[int]) -> None:
        """Tell the followers to run ``op`` (``admit``, ``keep``, ``step``, ``kv``) with ``values``."""
        if self.group is None:
            return
        inline = values if len(values) <= _INLINE else []
        self._sum([_OPS.index(op), len(values), *inline, *[0] * (_INLINE - len(inline))])
        if not inline and values:
            self._sum(values)

    def shutdown(self) -> None:
        if self.group is not None:
            self.send("shutdown", [])
            self.barrier()

    # a follower's side
    def receive(self) -> tuple[str, list[int]]:
        """The head's next operation and its values; after ``("shutdown", [])`` the closing barrier is done."""
        op, n, *inline = self._sum([0] * (2 + _INLINE))
        if _OPS[op] == "shutdown":
            self.barrier()
            return "shutdown", []
        return _OPS[op], inline[:n] if n <= _INLINE else self._sum([0] * n)

    # both sides
    def agree(self, ok: bool) -> bool:
        """Whether every rank answers ``ok`` to the same question (every rank calls this at the same point, each
        with its own answer; one process: its own)."""
        if self.group is None:
            return ok
        import mlx.core as mx

        out = mx.distributed.all_sum(mx.array([int(ok)], dtype=mx.int32), group=self.group, stream=mx.cpu)
        mx.eval(out)
        return int(out.item()) == self.size

    def barrier(self) -> None:
        """Drain local work, then one scalar all-sum: no rank exits while a peer still has a transfer pending."""
        import mlx.core as mx

        mx.synchronize()
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group, stream=mx.cpu))
