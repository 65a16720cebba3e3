"""``m3jax serve``'s HTTP server: the ASGI app (m3jax.serving_app) on uvicorn, on a socket bound before the model
loads (``bind``: a port in use fails at once; while loading, every route answers 503), then given its Server
(``attach``). uvicorn runs on a thread of its own, so the caller's thread stays free (``m3jax serve`` waits there
for Ctrl-C / SIGTERM)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from m3jax.serving import Server
from m3jax.serving_app import attach_server, create_app

__all__ = ["HttpServer", "attach", "bind", "serve"]

_GRACE_S = 5.0  # on stop, replies still being sent get this long before they are cut
_START_TIMEOUT_S = 60.0


class HttpServer:
  """uvicorn serving the app on a bound socket: ``start`` (a thread), ``wait`` (until stopped), ``stop``."""

  def __init__(self, sock: socket.socket):
    self.socket = sock
    self.app = create_app()
    config = uvicorn.Config(self.app, http="h11", loop="asyncio", lifespan="off", log_config=None,
                            access_log=False, timeout_graceful_shutdown=_GRACE_S)
    self._uvicorn = uvicorn.Server(config)
    self._thread: threading.Thread | None = None
    # Set when uvicorn has returned. Waited on instead of Thread.join: a signal interrupting join() can leave the
    # thread marked stopped while it still runs (CPython's bpo-45274 handling), and the socket closed under it.
    self._finished = threading.Event()

  @property
  def address(self) -> tuple[str, int]:
    """(host, port) it listens on."""
    return self.socket.getsockname()[:2]

  @property
  def url(self) -> str:
    host, port = self.address
    return f"http://{host}:{port}"

  def start(self) -> HttpServer:
    """Starts answering (on a daemon thread); returns once it does."""
    self._thread = threading.Thread(target=self._run, daemon=True, name="m3jax-http")
    self._thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not self._uvicorn.started:
      if self._finished.is_set() or time.monotonic() > deadline:
        raise RuntimeError(f"the HTTP server on {self.url} did not start")
      time.sleep(0.01)
    return self

  def _run(self) -> None:
    try:
      self._uvicorn.run(sockets=[self.socket])
    finally:
      self._finished.set()

  def wait(self) -> None:
    """Blocks until the server stops (Ctrl-C and SIGTERM still reach the calling thread)."""
    while self._thread is not None and not self._finished.wait(0.5):
      pass

  def stop(self) -> None:
    """Stops accepting, lets replies in flight finish (up to a few seconds), and closes the socket."""
    if self._thread is not None:
      self._uvicorn.should_exit = True
      self._finished.wait()
      self._thread = None
    self.socket.close()

  def __enter__(self) -> HttpServer:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def bind(host: str = "127.0.0.1", port: int = 8000) -> HttpServer:
  """Binds host:port now (port 0 picks a free one), so that a port in use fails before anything else is done;
  ``start`` answers 503 on it until ``attach`` gives it the Server. ValueError naming the address when it cannot
  listen there."""
  try:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
  except OSError as e:
    raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
  except OSError as e:
    sock.close()
    raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? pick another "
                     "--port)") from None
  return HttpServer(sock)


def attach(httpd: HttpServer, server: Server) -> HttpServer:
  """Makes a bound HTTP server answer with ``server``."""
  attach_server(httpd.app, server)
  return httpd


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000) -> HttpServer:
  """An HTTP server answering with ``server`` on host:port (port 0 picks a free one), started; ``stop`` it."""
  return attach(bind(host, port), server).start()
