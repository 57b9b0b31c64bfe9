"""Load a model version on Triton replicas one at a time through the repository API, and undo it.

Each replica runs with `--model-control-mode explicit` on the same repository (a shared folder or
bucket). `load_model` makes a replica read the repository again: it loads the version the config
names while the one it serves keeps serving, switches once the new one is ready and unloads the
old one (whose streams in flight finish first: model.py drains on unload). A replica is done when
the server and that version report ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class ReplicaFailed(RuntimeError):
    """One replica refused or did not finish the load: `url` and Triton's `reason`."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url, self.reason = url, reason


def _reason(err: Exception) -> str:
    text = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
    return text.strip().splitlines()[0] if text and text.strip() else "no reason given"  # the server log has the rest


@dataclass
class Replica:
    url: str
    client: object  # tritonclient.grpc.InferenceServerClient

    @classmethod
    def connect(cls, url: str) -> "Replica":
        """A live replica at `url` (gRPC address); ReplicaFailed when it does not answer."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url)
        try:
            if client.is_server_live():
                return cls(url, client)
            raise ReplicaFailed(url, "the server is not live")
        except ReplicaFailed:
            raise
        except Exception as err:  # InferenceServerException, or grpc's own
            raise ReplicaFailed(url, f"no Triton server there ({_reason(err)})") from None

    def load(self, model: str, version: int, timeout: float) -> None:
        """Load `model` (its config names `version`) and wait until that version is ready."""
        try:
            self.client.load_model(model)
        except Exception as err:
            raise ReplicaFailed(self.url, _reason(err)) from None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.client.is_server_ready() and self.client.is_model_ready(model, str(version)):
                    return
            except Exception as err:
                raise ReplicaFailed(self.url, f"stopped answering while loading ({_reason(err)})") from None
            time.sleep(0.2)
        raise ReplicaFailed(self.url, f"version {version} of {model} was not ready after {timeout:.0f} s")

    def reload(self, model: str) -> str | None:
        """Load what the repository now names (a rollback); the problem, if any, as text."""
        try:
            self.client.load_model(model)
            return None
        except Exception as err:
            return f"{self.url}: {_reason(err)}"

    def unload(self, model: str) -> str | None:
        try:
            self.client.unload_model(model)
            return None
        except Exception as err:
            return f"{self.url}: {_reason(err)}"

    def close(self) -> None:
        self.client.close()


def roll_out(replicas: list[Replica], model: str, version: int, timeout: float) -> list[Replica]:
    """Load `version` on each replica in turn; on the first failure raise ReplicaFailed with
    `.touched` set to the replicas asked to load (the failing one included), for the rollback."""
    touched: list[Replica] = []
    for replica in replicas:
        touched.append(replica)
        try:
            replica.load(model, version, timeout)
        except ReplicaFailed as err:
            err.touched = touched
            raise
    return touched


def roll_back(touched: list[Replica], model: str, keep_serving: bool) -> list[str]:
    """Make the touched replicas serve what the repository names again (reload), or unload the
    model when nothing was serving before; the problems met, as text."""
    problems = [replica.reload(model) if keep_serving else replica.unload(model) for replica in touched]
    return [p for p in problems if p]
