"""Run the OpenAI-compatible API with uvicorn: in the foreground (`llmc openai`) or on a thread
beside a Triton server (`llmc serve --openai-port`, tests)."""

from __future__ import annotations

import os
import threading
import time

API_KEY_ENV = "LLMC_API_KEY"  # the API key when --api-key is not given


class OpenAIServer:
    """uvicorn serving `create_app(urls, ...)` on `host:port` in a background thread."""

    def __init__(self, urls: list[str], *, host: str = "127.0.0.1", port: int = 9000, api_key: str | None = None,
                 **app_options):
        import uvicorn

        from llmc.openai.app import create_app

        self.host, self.port = host, port
        app = create_app(urls, api_key=api_key, **app_options)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="llmc-openai", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "OpenAIServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI API did not start on {self.host}:{self.port} (port in use?)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def api_key_from_env(explicit: str | None) -> str | None:
    return explicit or os.environ.get(API_KEY_ENV) or None


def run(urls: list[str], *, host: str, port: int, api_key: str | None, **app_options) -> None:
    """Serve in the foreground until Ctrl-C (`app_options`: create_app's, e.g. allow_lora_updates, repository)."""
    import uvicorn

    from llmc.openai.app import create_app

    try:
        app = create_app(urls, api_key=api_key, **app_options)
    except ValueError as err:
        from llmc.errors import ServingError

        raise ServingError(str(err)) from None
    uvicorn.run(app, host=host, port=port, log_level="warning")


def start_beside(grpc_url: str, port: int, api_key: str | None, **app_options) -> OpenAIServer | None:
    """`llmc serve --openai-port`: the API in front of the Triton server just started (port 0: none)."""
    from llmc.errors import ServingError

    if not port:
        return None
    try:
        return OpenAIServer([grpc_url], port=port, api_key=api_key_from_env(api_key), **app_options).start()
    except (RuntimeError, OSError) as err:
        raise ServingError(f"--openai-port {port}: {err}") from None
