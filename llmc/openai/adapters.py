"""LoRA adapters loaded and unloaded through the OpenAI API while the servers serve, as vLLM's endpoints are (behind
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` there; here behind `llmc serve --allow-lora-updates` / `llmc openai
--allow-lora-updates --repository R`, or LLMC_ALLOW_RUNTIME_LORA_UPDATING=1):

    POST /v1/load_lora_adapter     {"lora_name", "lora_path", "model"?, "lora_task_id"?}
    POST /v1/unload_lora_adapter   {"lora_name", "model"?, "wait"?}

`lora_path` is a PEFT adapter folder on the frontend's machine, or omitted to load the store's adapter again. The
adapter goes into the repository's store and onto every server of the pool serving the model (llmc/fleet/adapters.py);
`model` names the base model (default: the repository's only one). Errors are OpenAI's body with the status the
model's refusal maps to: 400 a bad adapter, 404 an unknown one, 409 one in use (`wait`: seconds an unload waits for
the requests using it), 503 a server unreachable. Without the flag the routes do not exist (404).
"""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from llmc.openai.protocol import OpenAIError

ALLOW_ENV = "LLMC_ALLOW_RUNTIME_LORA_UPDATING"
_CODES = {400: "invalid_adapter", 404: "adapter_not_found", 409: "adapter_in_use", 503: "service_unavailable"}


def allowed(flag: bool) -> bool:
    return flag or os.environ.get(ALLOW_ENV, "").lower() in ("1", "true", "yes")


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=64)
    lora_path: str | None = None
    model: str | None = None
    lora_task_id: int | None = Field(default=None, ge=0, lt=2**63)


class UnloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=64)
    model: str | None = None
    wait: float = Field(default=0.0, ge=0, le=600)


def add_routes(router: APIRouter, pool, repository: str) -> None:
    """The two routes on `router`, updating `repository`'s store and the servers in `pool`."""
    from llmc.fleet import adapters
    from llmc.fleet.objectstore import open_store
    from llmc.fleet.store import StoreError

    lock = asyncio.Lock()  # one update at a time: each rewrites the store's index

    def urls(model: str | None) -> list[str]:
        return [b.url for b in pool.healthy if model is None or model in b.models]

    async def run(fn, *args):
        try:
            async with lock:
                return await asyncio.to_thread(fn, open_store(repository), *args)
        except adapters.AdapterUpdateError as err:
            raise OpenAIError(err.status, str(err), "lora_name" if err.status in (404, 409) else "lora_path",
                              _CODES.get(err.status)) from None
        except StoreError as err:
            raise OpenAIError(503, str(err), None, "service_unavailable") from None
        finally:
            await pool.check_all()  # the servers' adapter lists, now

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadRequest):
        result = await run(adapters.load, req.model, req.lora_name, req.lora_path, urls(req.model), req.lora_task_id)
        return {"object": "lora_adapter", "id": req.lora_name, "parent": result["model"], "digest": result["digest"],
                "servers": sorted(result["replicas"])}

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadRequest):
        result = await run(adapters.unload, req.model, req.lora_name, urls(req.model), req.wait)
        return {"object": "lora_adapter", "id": req.lora_name, "parent": result["model"], "deleted": True,
                "servers": sorted(result["replicas"])}
