"""The node agent (``meshgate node``, or embedded in a single-machine gateway).

It registers its node with a heartbeat TTL, measures latency and bandwidth to the other agents, and reconciles:
every shard the stored instances place on this node gets a process (``Backend.launch``), reported back as a
``RunnerStatus``; processes whose instance is gone, failed or re-placed are stopped; a process that dies is
reported failed. Runtime processes bind to the node's cluster address, never a public one by default.

It serves two tiny endpoints for link probes (``GET /ping``, ``GET /blob?bytes=N``) and its Prometheus metrics
(``GET /metrics``, ``gateway.telemetry.node_metrics``) on the cluster address, to callers presenting the cluster
secret only (``backends.runner.secret``: ``authorization: Bearer`` or
``x-meshgate-secret``; others get 401), and presents it when it probes the other agents. The runners it launches
get the same secret from ``RunnerProcess.start``.

``drain`` (``SIGTERM`` to ``meshgate node``) stops a node without cutting a stream: the node record says
``draining_until``, so gateways place nothing new here, drain each replica on it (no new requests; running streams
finish) while they place a replacement elsewhere, and delete it once idle or at that time; the agent stops its
runners and leaves when none is left here, or at that time (and a margin) if no gateway acts.

Once at start, in worker threads, it asks each backend to measure this node with the runtime's own kernels
(``Backend.calibrate``) and adds what they measured to its node record (``Node.calibration``), the planner's
speed estimates; until then (and for a backend that does not measure) the planner uses ``Node.flops``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import httpx
import msgspec

from meshgate.backends.base import Backend, Launched, ModelCard
from meshgate.backends.placement import Calibration, Link, Node, NodeId
from meshgate.backends.runner import secret as cluster_secret
from meshgate.gateway.cluster import lifecycle
from meshgate.gateway.cluster.node import describe_node, measure_flops
from meshgate.gateway.cluster.records import Failed, Instance, RunnerState, RunnerStatus
from meshgate.gateway.cluster.recovery import REPUBLISH_WAIT, Incarnation
from meshgate.gateway.cluster.store import StateStore
from meshgate.gateway.telemetry.instruments import exposition
from meshgate.gateway.telemetry.node_metrics import NodeMetrics
from meshgate.protocols.model import StoreUnavailable

__all__ = ["NodeAgent"]

log = logging.getLogger("meshgate.agent")
T = TypeVar("T")
_BLOB = b"\0" * (1 << 20)


HEARTBEAT_RETRY = 0.1
"""Seconds between a node's heartbeats while the store does not take them."""


class NodeAgent:
    """One machine's agent: heartbeat, link probes, shard processes."""

    def __init__(
        self,
        store: StateStore,
        backends: Sequence[Backend],
        resolve: Callable[[str], ModelCard],
        *,
        choose: Callable[..., Backend | None],
        name: str | None = None,
        address: str = "127.0.0.1",
        port: int = 0,
        heartbeat: float = 1.0,
        ttl: float = 3.0,
        probe_every: float = 30.0,
        probe_bytes: int = 4 << 20,
        memory: int | None = None,
        flops: float | None = None,
        secret: str | None = None,
        tune_server: Callable[[Any], None] = lambda server: None,
    ) -> None:
        self.store = store
        self.tune_server = tune_server  # applied to the probe server (a uvicorn.Server) before it starts
        self.secret = secret or cluster_secret.current()
        self._secret_conflict = False
        self.backends = list(backends)
        self.resolve = resolve
        self.choose = choose
        self.name = name or socket.gethostname()
        self.node_id = NodeId(self.name)
        self.address = address
        self.port = port
        self.heartbeat = heartbeat
        self.ttl = ttl
        self.probe_every = probe_every
        self.probe_bytes = probe_bytes
        self.memory = memory
        self.launched: dict[str, tuple[int, Launched]] = {}
        self._starting: dict[str, asyncio.Task] = {}
        self._failed: dict[tuple[str, int], str] = {}  # (instance id, epoch) -> why its runner failed here
        self._tasks: list[asyncio.Task] = []
        self._flops = flops if flops is not None else measure_flops()
        self._server: Any = None
        self._wake = asyncio.Event()  # the instances changed: reconcile
        self._nodes_changed = asyncio.Event()  # a node joined, left or beat: the probe loop looks
        self._calibration: dict[str, Calibration] = {}  # each backend's measured speed here (``_calibrate``)
        self._measured: list[Link] = []  # the last probe's links from here
        self._epochs: dict[str, int] = {}  # instance id -> the epoch last launched here (restarts are counted)
        self.draining_until: float | None = None  # set by ``drain``: gateways move this node's replicas away
        self._closed = False
        self._incarnation = Incarnation(store)  # which store this is: one that restarted empty lost its instances
        self._hold_until = 0.0  # monotonic: until then runners whose instance the store lost keep running
        self.metrics = NodeMetrics(
            self.name,
            node=self._describe,
            links=lambda: self._measured,
            runners=lambda: len(self.launched),
        )

    @property
    def agent_url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        await self._serve_probes()
        await self._register()
        await self.store.append_event("node.joined", f"node {self.name} joined", node_id=self.node_id)
        self._tasks += [
            asyncio.create_task(c, name=n)
            for n, c in (
                ("agent-heartbeat", self._heartbeat_loop()),
                ("agent-reconcile", self._reconcile_loop()),
                ("agent-watch", self._watch()),
                ("agent-probe", self._probe_loop()),
                ("agent-calibrate", self._calibrate()),
            )
        ]

    async def close(self, *, deregister: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        for task in [*self._tasks, *self._starting.values()]:
            task.cancel()
        for task in [*self._tasks, *self._starting.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(launched.stop() for _, launched in self.launched.values()), return_exceptions=True)
        self.launched.clear()
        if deregister:
            with contextlib.suppress(Exception):
                await self.store.remove_node(self.node_id)
                await self.store.append_event("node.left", f"node {self.name} left", node_id=self.node_id)
        if self._server is not None:
            self._server.should_exit = True

    # ------------------------------------------------------------------------------------------- heartbeat

    def _describe(self) -> Node:
        """This node as it stands now (memory read again), with what it has measured."""
        node = describe_node(
            self.name,
            self.address,
            self.agent_url,
            flops=self._flops,
            memory=self.memory,
            calibration=self._calibration,
        )
        return msgspec.structs.replace(node, draining_until=self.draining_until)

    async def drain(self, grace: float, margin: float = 5.0) -> None:
        """Leave the cluster without cutting a stream: say the node drains for ``grace`` seconds, wait until no
        instance is placed here any more (the gateways drain and delete them), at most ``grace`` + ``margin``
        seconds, then ``close``."""
        self.draining_until = time.time() + grace
        try:
            await self._register()
            await self.store.append_event(
                "node.draining", f"node {self.name} drains: its streams have {grace:g}s to finish", node_id=self.node_id
            )
        except StoreUnavailable:  # the heartbeat says it again (``_describe``) once the store answers
            log.warning("node %s draining; the state store is away: the gateways learn it once it is back", self.name)
        log.info("node %s draining: up to %gs for its streams to finish", self.name, grace)
        deadline = time.monotonic() + grace + margin
        while time.monotonic() < deadline:
            try:
                if not [i for i in await self.store.instances() if lifecycle.placed_on(i, self.node_id)]:
                    break
            except StoreUnavailable:  # a SIGTERM is still a drain: its streams keep their grace
                pass
            await asyncio.sleep(0.25)
        else:
            log.warning("node %s: its replicas were not drained within %gs; stopping them", self.name, grace)
        await self.close()

    async def _register(self) -> None:
        await self.store.put_node(self._describe(), self.ttl)

    async def _calibrate(self) -> None:
        """Each backend's speed on this node (``Backend.calibrate``, blocking: in a daemon thread of its own),
        registered as soon as it is known."""
        for backend in self.backends:
            try:
                found = await _in_daemon_thread(backend.calibrate, f"calibrate-{backend.name}")
            except Exception:
                log.exception("calibrating %s failed; the planner estimates its speed from flops", backend.name)
                continue
            if found is not None:
                self._calibration = {**self._calibration, backend.name: found}
                log.info("%s on %s: %s", backend.name, self.name, found)
                await self._register()

    async def _heartbeat_loop(self) -> None:
        """Beat every ``heartbeat`` seconds; after a beat the store did not take (away, or slower than its
        timeout), again every ``HEARTBEAT_RETRY`` seconds until it does: the beat that timed out used up most of
        the node's time to live, and a node the store lets lapse looks dead to every gateway."""
        wait = self.heartbeat
        while True:
            await asyncio.sleep(wait)
            try:
                await self._register()
                await self._hold_secret()
                wait = self.heartbeat
            except StoreUnavailable:
                if wait == self.heartbeat:
                    log.warning("heartbeat: the state store is away; trying again every %gs", HEARTBEAT_RETRY)
                wait = min(HEARTBEAT_RETRY, self.heartbeat)
            except Exception:
                log.exception("heartbeat failed")
                wait = self.heartbeat

    async def _hold_secret(self) -> None:
        """Confirm the secret this node's runners demand, or put it back where the store lost it or holds one a
        process made up meanwhile (``StateStore.cluster_secret``, ``held``)."""
        stored = await self.store.cluster_secret(self.secret, held=True)
        if stored != self.secret and not self._secret_conflict:
            self._secret_conflict = True
            log.error(
                "the state store holds another confirmed cluster secret than this node's runners demand: set the "
                "same MESHGATE_CLUSTER_SECRET everywhere, or restart this agent to take the stored one"
            )

    # ------------------------------------------------------------------------------------------- shards

    async def _watch(self) -> None:
        async for kind in self.store.watch():
            if kind == "instances":  # what runs here follows the instances only (heartbeats change "nodes")
                self._wake.set()
            elif kind == "nodes":
                self._nodes_changed.set()

    async def _reconcile_loop(self) -> None:
        """Reconcile when the instances change, and every 0.5 s (a runner process that died is seen then)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):  # no task per wait, as ``wait_for`` makes in Python 3.11
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.reconcile()
            except StoreUnavailable:
                log.warning("agent reconcile: the state store is away; trying again in 0.5s")
            except Exception:
                log.exception("agent reconcile failed")

    async def reconcile(self) -> None:
        """Start what is placed here, stop what is not, report processes that died (``lifecycle.shard_plan``)."""
        stored = await self.store.instances()
        if (incarnation := await self._incarnation.new()) is not None:  # asked after the read: see ``recovery``
            self._incarnation.accept(incarnation)
            self._hold_until = time.monotonic() + REPUBLISH_WAIT
            log.warning("the state store restarted empty: %s keeps its runners for the gateways to put back", self.name)
        holding = time.monotonic() < self._hold_until
        known = {i.id for i in stored}
        if not holding:  # forget deleted ones
            self._epochs = {i.id: self._epochs[i.id] for i in stored if i.id in self._epochs}
        running = {iid: (epoch, launched.alive) for iid, (epoch, launched) in self.launched.items()}
        for step in lifecycle.shard_plan(self.node_id, stored, running, set(self._starting), self._failed.keys()):
            if holding and isinstance(step, lifecycle.Stop) and step.instance_id not in known:
                continue  # not deleted: a store that restarted empty does not have it back yet
            if isinstance(step, lifecycle.Launch):
                self._starting[step.instance.id] = asyncio.create_task(self._launch(step.instance))
                continue
            _, launched = self.launched.pop(step.instance_id if isinstance(step, lifecycle.Stop) else step.instance.id)
            await launched.stop()  # a dead one's too: what it left (children, runtime folders, shm segments)
            if isinstance(step, lifecycle.Stop):
                log.info("stopped shard of %s (epoch %s)", step.instance_id, step.epoch)
            else:
                self._failed[(step.instance.id, step.epoch)] = "the runner process exited"
                await self._report(step.instance, "failed", error="the runner process exited")
        await self._report_unreported(stored)

    async def _launch(self, instance: Instance) -> None:
        try:
            shard = next(s for s in instance.placement.shards if s.node_id == self.node_id)
            if instance.id in self._epochs:  # ran here before: re-placed, or its runner died
                self.metrics.restarted(instance.model)
            self._epochs[instance.id] = instance.epoch
            with contextlib.suppress(StoreUnavailable):  # what it comes to is said, or said again, later
                await self._report(instance, "starting")
            card = self.resolve(instance.model)
            backend = next((b for b in self.backends if b.name == instance.placement.backend), None)
            if backend is None:
                raise RuntimeError(f"backend {instance.placement.backend} is not installed on {self.name}")
            launched = await backend.launch(
                card, instance.placement, shard, host=self.address, peers=lambda: self._peers(instance)
            )
            self.launched[instance.id] = (instance.epoch, launched)
            try:
                await self._report(instance, "ready", url=launched.url, pid=launched.pid)
            except StoreUnavailable:  # it runs: a later reconcile pass says so (``_report_unreported``)
                log.warning("started %s; the state store is away: it is reported once it is back", instance.model)
                return
            log.info("started shard of %s on %s: %s", instance.model, self.name, launched.url)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("could not start %s: %s", instance.model, exc)
            error = self._failed[(instance.id, instance.epoch)] = str(exc) or type(exc).__name__
            with contextlib.suppress(StoreUnavailable):  # else a later reconcile pass reports it
                await self._report(instance, "failed", error=error)
        finally:
            self._starting.pop(instance.id, None)
            self._wake.set()

    async def _report_unreported(self, stored: list[Instance]) -> None:
        """Say again what a report lost to a store outage (or a store that restarted empty) left unsaid: each
        runner started here for an instance's current epoch is ready, each that failed here failed."""
        for instance in stored:
            status = instance.runners.get(self.node_id)
            said = (status.state, status.epoch) if status is not None else None
            epoch, launched = self.launched.get(instance.id, (None, None))
            if launched is not None and epoch == instance.epoch and launched.alive and said != ("ready", epoch):
                await self._report(instance, "ready", url=launched.url, pid=launched.pid)
            error = self._failed.get((instance.id, instance.epoch))
            if error is not None and said != ("failed", instance.epoch):
                await self._report(instance, "failed", error=error)

    async def _peers(self, instance: Instance, timeout: float = 300.0) -> dict[str, str]:
        """Wait until every other shard of ``instance`` reports ready for its epoch; their URLs by node id."""
        others = [s.node_id for s in instance.placement.shards if s.node_id != self.node_id]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = await self.store.get_instance(instance.id)
            if current is None or current.epoch != instance.epoch or isinstance(current.state, Failed):
                raise RuntimeError("the placement changed while waiting for its other shards")
            statuses = {n: current.runners.get(n) for n in others}
            failed = [s for s in statuses.values() if s and s.epoch == instance.epoch and s.state == "failed"]
            if failed:
                raise RuntimeError(f"shard on {failed[0].node_id} failed: {failed[0].error}")
            urls = {n: s.url for n, s in statuses.items() if s and s.epoch == instance.epoch and s.state == "ready"}
            if len(urls) == len(statuses) and all(urls.values()):
                return {n: url for n, url in urls.items() if url}
            await asyncio.sleep(0.1)
        raise TimeoutError(f"the other shards were not up within {timeout:.0f}s")

    async def _report(
        self,
        instance: Instance,
        state: RunnerState,
        *,
        url: str | None = None,
        pid: int | None = None,
        error: str | None = None,
    ) -> None:
        await self.store.update_runner(
            instance.id,
            RunnerStatus(node_id=self.node_id, state=state, url=url, pid=pid, error=error, epoch=instance.epoch),
        )

    # ------------------------------------------------------------------------------------------- links

    async def _probe_loop(self) -> None:
        """Probe every ``probe_every`` seconds, and at once when the set of nodes changes: looked at when the
        store says the nodes changed (heartbeats included), at most twice a second, with no timer of its own."""
        known: set[NodeId] = set()
        last = looked = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.5, last + self.probe_every - time.monotonic())):
                    await self._nodes_changed.wait()
            if (early := looked + 0.5 - time.monotonic()) > 0:  # many nodes beating: not a look per beat
                await asyncio.sleep(early)
            self._nodes_changed.clear()
            looked = time.monotonic()
            try:
                peers = {n.id for n in await self.store.nodes()} - {self.node_id}
                if peers != known or time.monotonic() - last > self.probe_every:
                    known, last = peers, time.monotonic()
                    await self.probe_links()
            except StoreUnavailable:
                log.warning("link probe: the state store is away")
            except Exception:
                log.exception("link probe failed")

    async def probe_links(self) -> list[Link]:
        """Measure latency (best of 5 pings, halved) and bandwidth (one blob) to every other agent."""
        links: list[Link] = []
        others = [n for n in await self.store.nodes() if n.id != self.node_id and n.agent_url]
        if not others:
            return links  # a client costs ~20 ms of CPU (its TLS context): none for nothing to probe
        async with httpx.AsyncClient(
            timeout=10.0, trust_env=False, headers={"authorization": f"Bearer {self.secret}"}
        ) as http:
            for node in others:
                try:
                    rtts = []
                    for _ in range(5):
                        started = time.perf_counter()
                        (await http.get(f"{node.agent_url}/ping")).raise_for_status()
                        rtts.append(time.perf_counter() - started)
                    received, first_byte_at = 0, None
                    async with http.stream(
                        "GET", f"{node.agent_url}/blob", params={"bytes": self.probe_bytes}
                    ) as response:
                        response.raise_for_status()
                        async for chunk in response.aiter_raw():
                            if first_byte_at is None:
                                first_byte_at = time.perf_counter()  # from the first byte: no latency in it
                            else:
                                received += len(chunk)
                    elapsed = time.perf_counter() - (first_byte_at or time.perf_counter())
                except httpx.HTTPError as exc:
                    log.info("cannot probe %s: %s", node.id, exc)
                    continue
                if received == 0 or elapsed <= 0:
                    continue  # one chunk: too small a sample to say anything about bandwidth
                link = Link(
                    src=self.node_id,
                    dst=node.id,
                    latency=min(rtts) / 2,
                    bandwidth=received / elapsed,
                    measured_at=time.time(),
                )
                await self.store.put_link(link)
                links.append(link)
        self._measured = links
        return links

    async def _serve_probes(self) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.address, self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        app = _ProbeApp(self.secret.encode(), self.metrics)
        # no log_level: uvicorn would set it on its process-wide "uvicorn.error" logger, which the gateway's own
        # server (an embedded agent shares its process) logs its start and stop to; _quiet_probes mutes this one
        config = uvicorn.Config(app, access_log=False, lifespan="off", log_config=None)
        _quiet_probes()
        self._server = _probe_server(config)
        self.tune_server(self._server)
        self._tasks.append(asyncio.create_task(self._server.serve(sockets=[sock]), name=PROBES_TASK))


PROBES_TASK = "agent-probes"


async def _in_daemon_thread(call: Callable[[], T], name: str) -> T:
    """``call()`` in a daemon thread, awaited. Not ``asyncio.to_thread``: the default executor's threads are joined
    when the loop and the interpreter end, so a ``SIGTERM`` during a calibration (minutes, on a busy machine) would
    wait for it, past any drain grace. A daemon thread is left behind at exit (what it started may finish)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # cancelled meanwhile: nobody waits for it
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]  # T, when no error

    def work() -> None:
        result, error = None, None
        try:
            result = call()
        except BaseException as exc:  # handed to the awaiting task, which decides
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await done


def _probe_server(config: Any) -> Any:
    """A ``uvicorn.Server`` for ``config`` that leaves signals alone. Since uvicorn 0.29 ``serve`` takes SIGINT
    and SIGTERM on the main thread and raises them again once it has shut down: the probe server would stop at the
    node's first ``SIGTERM``, and that signal would reach the process's own handler twice (asyncio's wake-up fd
    sees it at once, uvicorn raises it again seconds later), which ``meshgate node`` reads as "stop at once",
    cutting its drain short. The process's owner handles signals; the probe server stops when the agent closes."""
    import uvicorn

    class ProbeServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return ProbeServer(config)


def _quiet_probes() -> None:
    """Keep the probe server's start and stop lines (uvicorn's INFO records, logged from its task) out of the
    log: a gateway with an embedded agent would otherwise print two "Uvicorn running on" lines, one of them the
    probe port. Installed once per process."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ProbeFilter) for f in logger.filters):
        logger.addFilter(_ProbeFilter())


class _ProbeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop
            return True
        return task is None or task.get_name() != PROBES_TASK


class _ProbeApp:
    """The probe endpoints and ``/metrics``, to callers with ``secret`` only."""

    def __init__(self, secret: bytes, metrics: NodeMetrics) -> None:
        self.secret = secret
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        if not cluster_secret.authorized_asgi(self.secret, scope["headers"]):
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"error":"missing or wrong cluster secret"}'})
            return
        if scope["path"] == "/metrics":
            accept = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"accept"), "")
            body, content_type = exposition(self.metrics.registry, accept)
            headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await _probe_app(scope, receive, send)


async def _probe_app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    if scope["path"] == "/blob":
        query = dict(p.split("=", 1) for p in scope.get("query_string", b"").decode().split("&") if "=" in p)
        size = min(int(query.get("bytes", len(_BLOB))), 64 << 20)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())],
            }
        )
        while size > 0:
            chunk = _BLOB[: min(size, len(_BLOB))]
            size -= len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": size > 0})
        return
    status, body = (200, b"pong") if scope["path"] == "/ping" else (404, b"not found")
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})
