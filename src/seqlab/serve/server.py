"""Run the app under uvicorn on a socket we bind ourselves; SIGTERM drains in-flight requests and exits cleanly.

Why bind the socket here: a port in use or a bad host is then an ordinary ``OSError`` the CLI reports in one line,
and the ``listening on`` line is printed only once the server really accepts connections. Uvicorn's graceful
shutdown (stop accepting, let open responses finish for ``shutdown_timeout`` seconds, then cancel them) does the
draining. The engine is stopped alongside, a little before that deadline: it ends each reply still running with an
error event, which its handler sends (an OpenAI-style error, or an error chunk and ``[DONE]`` in a stream) before
uvicorn would cancel the handler and cut the connection with a bare 500 or a truncated stream.
"""

from __future__ import annotations

import asyncio
import signal
import socket

import uvicorn

from seqlab.serve.scheduler import Engine


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from e
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


ERROR_DELIVERY_S = 1.0  # of the grace period, kept for the handlers to send the engine's shutdown errors


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, host: str, on_listening, engine: Engine):
        super().__init__(config)
        self.host, self.on_listening, self.engine = host, on_listening, engine

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown  # None: uvicorn waits for every reply, and so does the engine
        drain = float("inf") if grace is None else max(grace - ERROR_DELIVERY_S, grace / 2)
        stopping = asyncio.get_running_loop().run_in_executor(None, self.engine.stop, drain)
        await super().shutdown(sockets=sockets)
        await stopping

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.servers:
            port = self.servers[0].sockets[0].getsockname()[1]
            self.on_listening(f"http://{self.host}:{port}")


def serve(app, engine: Engine, sock: socket.socket, host: str, shutdown_timeout: float = 10.0,
          on_listening=lambda url: print(f"listening on {url}", flush=True)) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully; returns normally after SIGTERM (SIGINT is re-raised
    by uvicorn as KeyboardInterrupt, which the CLI reports as an interrupt, exit status 130)."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=shutdown_timeout)
    server = _Server(config, host, on_listening, engine)
    # uvicorn re-raises the signal it shut down for once it is done; a SIGTERM handler of our own turns that
    # into a normal return (exit status 0) instead of death by signal
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(timeout=1.0)
        signal.signal(signal.SIGTERM, previous)
        sock.close()
