"""Run one GGUF split across llama.cpp RPC workers: the worker process and the head's primitives.

The worker, ``python -m meshgate.backends.llama_cpp.rpc --host H --port P [--threads N] [--cache-dir D]``, serves ggml's
CPU device over ggml's RPC protocol. It follows the runner conventions of ``backends.runner.process``: it prints
``MESHGATE_RUNNER_READY port=N`` once its socket listens and exits when its stdin reaches EOF, so
``RunnerProcess.start`` supervises it and it never outlives the agent that started it. ggml's server binds IPv4
addresses only and has no authentication: the worker refuses the wildcard address unless ``--allow-public``.

The head is the runner process that creates ``Llama``. Before that it calls ``add_rpc_servers`` (which probes
every worker first: an unreachable worker aborts the whole process inside llama.cpp, with no exception), then
``split_kwargs`` to turn a placement's layer ranges into ``Llama`` keyword arguments.

How llama.cpp places a model (``llama_model_base::load_tensors``; checked by measurement): the positions are the
``n_layers`` blocks plus one more for the output layer (``n_layers + 1`` in all). Positions before
``n_layers + 1 - n_gpu_layers`` stay on the head's CPU; the rest are spread over the devices in the order of
their cumulative ``tensor_split`` shares, so a block range per device is a prefix-sum boundary, and the output
layer always lands on the device holding the last position (the last shard). The input token embedding always
stays on the head's CPU, memory-mapped from the GGUF. A tied output layer (Gemma: the token embedding doubles as
the output) is loaded a second time, whole, onto the last shard; reading it for that upload leaves the whole
embedding resident in the head as file-backed pages.

Imports protocols and, lazily, llama_cpp; never the gateway.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshgate.protocols.model import BackendUnavailable

__all__ = ["RpcDevice", "add_rpc_servers", "main", "probe", "rpc_devices", "split_kwargs", "weight_repacking"]

READY_LINE = "MESHGATE_RUNNER_READY"  # the same line backends.runner.server prints
DEFAULT_PORT = 50052

# ggml's RPC wire protocol (ggml-rpc.h / ggml-rpc.cpp of the bundled llama.cpp): a request is
# | command (1 byte) | size (8 bytes LE) | payload |, a response | size (8 bytes LE) | payload |.
_PROTO_MAJOR, _PROTO_MINOR = 7, 0
_CMD_HELLO, _CMD_DEVICE_COUNT = 14, 15
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities; all zero = plain TCP

# enum ggml_backend_dev_type
_DEV_CPU, _DEV_GPU, _DEV_IGPU, _DEV_ACCEL = 0, 1, 2, 3


# ------------------------------------------------------------------------------------------------ ggml access


class _Ggml:
    """The few ggml registry functions we call, resolved through libllama's own handle.

    The wheel ships ``libggml.so``, ``.so.0`` and ``.so.0.x`` as separate copies: opening one directly would load
    a second ggml whose backend registry llama never reads. Fresh function objects, so the argtypes we set never
    touch llama_cpp's own bindings.
    """

    def __init__(self) -> None:
        from llama_cpp import llama_cpp

        lib = llama_cpp._lib
        p, s, c = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p

        def fn(name: str, restype: Any, *argtypes: Any) -> Any:
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))

        self.reg_by_name = fn("ggml_backend_reg_by_name", p, c)
        self.reg_name = fn("ggml_backend_reg_name", c, p)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", p, p, c)
        self.register = fn("ggml_backend_register", None, p)
        self.dev_count = fn("ggml_backend_dev_count", s)
        self.dev_get = fn("ggml_backend_dev_get", p, s)
        self.dev_by_type = fn("ggml_backend_dev_by_type", p, ctypes.c_int)
        self.dev_type = fn("ggml_backend_dev_type", ctypes.c_int, p)
        self.dev_name = fn("ggml_backend_dev_name", c, p)
        self.dev_description = fn("ggml_backend_dev_description", c, p)
        self.dev_memory = fn("ggml_backend_dev_memory", None, p, ctypes.POINTER(s), ctypes.POINTER(s))
        self.dev_backend_reg = fn("ggml_backend_dev_backend_reg", p, p)
        self.rpc_reg = self.reg_by_name(b"RPC")
        if not self.rpc_reg:
            raise BackendUnavailable(
                "this llama-cpp-python was built without ggml's RPC backend (rebuild with CMAKE_ARGS=-DGGML_RPC=ON)"
            )

    def rpc_proc(self, name: str, restype: Any, *argtypes: Any) -> Any:
        address = self.reg_get_proc_address(self.rpc_reg, name.encode())
        if not address:
            raise BackendUnavailable(f"ggml's RPC backend does not export {name}")
        return ctypes.CFUNCTYPE(restype, *argtypes)(address)


_ggml_instance: _Ggml | None = None
_lock = threading.Lock()  # registration
_params_lock = threading.Lock()  # weight_repacking's patch
_registered: set[str] = set()  # endpoints registered with ggml in this process


def _ggml() -> _Ggml:
    global _ggml_instance
    if _ggml_instance is None:
        _ggml_instance = _Ggml()
    return _ggml_instance


# ------------------------------------------------------------------------------------------------ the head


@dataclass(frozen=True)
class RpcDevice:
    """One device as llama.cpp will use it; ``index`` is its position in ``tensor_split``.

    ``endpoint`` is ``host:port`` for an RPC worker, ``None`` for a local accelerator.
    """

    index: int
    name: str
    description: str
    endpoint: str | None
    memory_free: int
    memory_total: int


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an RPC endpoint is host:port with a port in 1-65535, not {endpoint!r}")
    return host, int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the worker closed the connection")
        data += chunk
    return data


def _call(sock: socket.socket, command: int, payload: bytes, answer_size: int) -> bytes:
    sock.sendall(bytes([command]) + struct.pack("<Q", len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != answer_size:
        raise ConnectionError(f"unexpected answer size {size} to command {command} (expected {answer_size})")
    return _recv_exact(sock, size)


def probe(endpoint: str, timeout: float = 5.0) -> None:
    """Check that an RPC worker answers at ``endpoint`` (``host:port``) with a protocol llama.cpp accepts.

    Does the handshake llama.cpp would do, so a closed port, a silent or busy worker (a worker serves one client
    at a time) and an incompatible version all raise ``BackendUnavailable`` here, within about ``timeout``
    seconds, instead of aborting the process later.
    """
    host, port = _split_endpoint(endpoint)
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            hello = _call(sock, _CMD_HELLO, bytes(_CONN_CAPS), 4 + _CONN_CAPS)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != _PROTO_MAJOR or minor > _PROTO_MINOR:
                raise BackendUnavailable(
                    f"RPC worker {endpoint} speaks protocol {major}.{minor}.{patch}; this "
                    f"llama.cpp needs {_PROTO_MAJOR}.x up to {_PROTO_MAJOR}.{_PROTO_MINOR}"
                )
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            (count,) = struct.unpack("<I", _call(sock, _CMD_DEVICE_COUNT, b"", 4))
            if count == 0:
                raise BackendUnavailable(f"RPC worker {endpoint} serves no devices")
    except TimeoutError:
        raise BackendUnavailable(
            f"RPC worker {endpoint} did not answer within {timeout:g}s (unreachable, or busy serving another client)"
        ) from None
    except (OSError, ConnectionError) as exc:
        raise BackendUnavailable(f"RPC worker {endpoint} is unreachable: {exc}") from None


def add_rpc_servers(endpoints: Sequence[str], *, timeout: float = 5.0) -> list[RpcDevice]:
    """Probe, then register RPC workers with ggml so the next ``Llama`` offloads onto them.

    Call in the head runner process, before creating ``Llama``, with the endpoints in pipeline order (a worker's
    devices take the next ``tensor_split`` positions; llama.cpp cannot reorder them). Registering an endpoint
    twice is a no-op. Returns every device in the order llama.cpp will use, the order ``split_kwargs`` needs.
    """
    for endpoint in endpoints:
        probe(endpoint, timeout)
    g = _ggml()
    add_server = g.rpc_proc("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    with _lock:
        for endpoint in endpoints:
            if endpoint in _registered:
                continue
            reg = add_server(endpoint.encode())
            if not reg:
                raise BackendUnavailable(f"RPC worker {endpoint} reports no devices")
            g.register(reg)
            _registered.add(endpoint)
    return rpc_devices()


def rpc_devices() -> list[RpcDevice]:
    """The devices llama.cpp will offload to, in its order (``llama_model_load_from_file`` with no explicit
    device list): every RPC device first, in registration order (a worker's devices report the RPC backend
    and describe themselves by their endpoint), then other GPUs in registry order (llama.cpp also skips a GPU
    whose device id repeats another's), integrated GPUs only when there is no other GPU. The CPU is not in
    the list: it holds whatever is not offloaded."""
    g = _ggml()
    rpc: list[Any] = []  # ggml device handles
    gpus: list[Any] = []
    igpus: list[Any] = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        kind = g.dev_type(dev)
        reg = g.dev_backend_reg(dev)
        if kind == _DEV_GPU:
            (rpc if g.reg_name(reg) == b"RPC" else gpus).append(dev)
        elif kind == _DEV_IGPU and (not igpus or g.dev_backend_reg(igpus[-1]) == reg):
            igpus.append(dev)
    devices = []
    for index, dev in enumerate(rpc + gpus + ([] if gpus else igpus)):
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        description = g.dev_description(dev).decode()
        devices.append(
            RpcDevice(
                index=index,
                name=g.dev_name(dev).decode(),
                description=description,
                endpoint=description if index < len(rpc) else None,
                memory_free=free.value,
                memory_total=total.value,
            )
        )
    return devices


def split_kwargs(
    shards: Sequence[tuple[str | None, int, int]], n_layers: int, devices: Sequence[RpcDevice]
) -> dict[str, Any]:
    """``Llama`` keyword arguments that put exactly each shard's blocks on its device.

    ``shards`` are ``(endpoint, layer_start, layer_end)`` in pipeline order, ``layer_end`` exclusive, covering
    ``0..n_layers`` contiguously; endpoint ``None`` (first shard only) keeps those blocks in the head process on
    its CPU. A shard may hold no blocks. The output layer goes with the last shard (the last one must be an RPC
    worker). ``devices`` is what ``add_rpc_servers`` returned; each shard's endpoint must be registered, in
    pipeline order. Positions are the blocks plus the output layer; each offloaded shard's share ends half a
    position before its boundary, so float rounding can never move a block across it.
    """
    from llama_cpp import llama_cpp

    if not shards:
        raise ValueError("a placement needs at least one shard")
    expected = 0
    for _endpoint, start, end in shards:
        if start != expected or end < start:
            raise ValueError(f"shards must cover 0..{n_layers} contiguously in order; got {list(shards)}")
        expected = end
    if expected != n_layers:
        raise ValueError(f"shards end at layer {expected}, the model has {n_layers}")
    local = shards[0][0] is None
    remote = shards[1:] if local else shards
    if any(endpoint is None for endpoint, _, _ in remote):
        raise ValueError("only the first shard can run in the head process")
    endpoints = [endpoint for endpoint, _, _ in remote if endpoint is not None]
    if not remote:
        return {"n_gpu_layers": 0, "split_mode": llama_cpp.LLAMA_SPLIT_MODE_LAYER, "main_gpu": 0}
    index_of = {d.endpoint: d.index for d in devices if d.endpoint is not None}
    missing = [endpoint for endpoint in endpoints if endpoint not in index_of]
    if missing:
        raise ValueError(f"RPC workers not registered (call add_rpc_servers first): {missing}")
    indices = [index_of[endpoint] for endpoint in endpoints]
    if indices != sorted(set(indices)):
        raise ValueError("register the workers in pipeline order: llama.cpp fills devices in registry order")
    if len(devices) > llama_cpp.LLAMA_MAX_DEVICES:
        raise ValueError(f"llama.cpp handles at most {llama_cpp.LLAMA_MAX_DEVICES} devices, {len(devices)} found")

    first = shards[0][2] if local else 0  # the first offloaded position
    positions = n_layers + 1 - first  # offloaded blocks + the output layer
    cumulative = [end - first - 0.5 for _, _, end in remote[:-1]] + [float(positions)]
    split = [0.0] * len(devices)
    previous = 0.0
    for index, bound in zip(indices, cumulative, strict=True):
        split[index] = bound - previous
        previous = bound
    return {
        "n_gpu_layers": positions if local else -1,
        "split_mode": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
        "main_gpu": 0,
        "tensor_split": split,
    }  # main_gpu matters only without a layer split


@contextlib.contextmanager
def weight_repacking(enabled: bool) -> Iterator[None]:
    """Create ``Llama`` inside this to choose whether llama.cpp repacks CPU weights (``use_extra_bufts``).

    Repacking (on by default) lays weights out for faster CPU matmuls, which changes the float results. RPC
    workers never repack (they allocate plain CPU buffers), so a local run must load with repacking off to give
    the same tokens as a split run. llama-cpp-python 0.3.36 has no keyword for it: this wraps the module's
    ``llama_model_default_params``, which ``Llama.__init__`` calls once.
    """
    from llama_cpp import llama_cpp

    original = llama_cpp.llama_model_default_params

    def patched() -> Any:
        params = original()
        params.use_extra_bufts = enabled
        return params

    with _params_lock:
        llama_cpp.llama_model_default_params = patched
        try:
            yield
        finally:
            llama_cpp.llama_model_default_params = original


# ------------------------------------------------------------------------------------------------ the worker


def _listening_port() -> int | None:
    """The port of this process's listening TCP socket (ggml's server), from /proc; None while there is none."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    with open("/proc/self/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                return int(fields[1].rsplit(":", 1)[1], 16)
    return None


def _connects(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def _announce_when_listening(host: str, port: int, out: Any) -> None:
    """Print the ready line once the server listens: our own listening socket in /proc where there is one (so a
    stranger already on the port cannot fake it), else a connection that succeeds (the worker shrugs it off)."""
    linux = os.path.isdir("/proc/self/fd")
    while True:
        found = _listening_port() if linux else (port if _connects(host, port) else None)
        if found:
            out.write(f"{READY_LINE} port={found}\n")
            out.flush()
            return
        time.sleep(0.02)


def _exit_on_stdin_eof() -> None:
    """Whoever started us holds our stdin open; EOF means it is gone, so the worker goes too."""
    with contextlib.suppress(Exception):
        while os.read(0, 1024):
            pass
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshgate-rpc-worker", description=__doc__.split("\n\n")[1])
    parser.add_argument("--host", required=True, help="IPv4 address to bind (loopback or a cluster interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--cache-dir", default=None, help="tensor cache that makes reloading cheap")
    parser.add_argument("--allow-public", action="store_true", help="allow binding the wildcard address")
    args = parser.parse_args(argv)
    try:
        address = ipaddress.ip_address(args.host)
    except ValueError:
        parser.error(f"--host must be an IP address, not {args.host!r}")
    if address.is_unspecified and not args.allow_public:
        parser.error(
            "refusing to bind every interface: the RPC protocol has no authentication; bind loopback "
            "or a private cluster address, or pass --allow-public"
        )
    if address.version != 4:
        parser.error("ggml's RPC server binds IPv4 addresses only")
    if not 0 <= args.port < 65536:
        parser.error("--port must be in 0-65535")
    port = args.port
    if port == 0 and not os.path.isdir("/proc/self/fd"):  # no way to read the port back: choose one now
        with socket.socket() as s:
            s.bind((args.host, 0))
            port = s.getsockname()[1]
    if args.cache_dir:
        os.makedirs(args.cache_dir, exist_ok=True)
    threads = args.threads or os.cpu_count() or 1

    # ggml prints its banner and one line per client to C stdout: send that to stderr, keep stdout for us.
    ready_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the server loop never returns to Python to see Ctrl-C

    try:
        g = _ggml()
    except BackendUnavailable as exc:
        sys.exit(f"meshgate-rpc-worker: {exc}")
    start_server = g.rpc_proc(
        "ggml_backend_rpc_start_server",
        None,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
    )
    cpu = g.dev_by_type(_DEV_CPU)
    if not cpu:
        sys.exit("ggml has no CPU device")
    devices = (ctypes.c_void_p * 1)(cpu)
    threading.Thread(target=_exit_on_stdin_eof, name="parent-watch", daemon=True).start()
    threading.Thread(
        target=_announce_when_listening, args=(args.host, port, ready_out), name="ready", daemon=True
    ).start()
    cache = os.fsencode(args.cache_dir) if args.cache_dir else None
    # Serves clients one after another until the process ends; it returns only when it cannot listen.
    start_server(f"{args.host}:{port}".encode(), cache, threads, 1, devices)
    sys.stderr.write(f"meshgate-rpc-worker: could not serve on {args.host}:{port} (port in use?)\n")
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    main()
