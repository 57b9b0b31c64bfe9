"""Package stage (`PACKAGE`): a Triton model repository that serves the build.

    <output>/model_repository/<name>/config.pbtxt        decoupled Python-backend model (triton_config.py),
                                                         KIND_CPU instances, KIND_GPU for a TensorRT engine
    <output>/model_repository/<name>/1/model.py          the thin model from model_repository/
    <output>/model_repository/<name>/1/model.onnx ...    the engine (hard links to the export, quantize or
                                                         engine stage's files: model.onnx or model.plan)
    <output>/model_repository/<name>/1/draft/model.onnx   speculative.method draft: the draft graph (links to the
                                                         draft stage's files), named in the manifest
    <output>/model_repository/<name>/1/tokenizer.json    AutoTokenizer's own pipeline, checked against it on sample
                                                         texts and the chat template (repository/tokenizer.py)
    <output>/model_repository/<name>/1/serving_env.tar.gz  execution_env: the serving packages for the container's
                                                         Python (a link to the environment stage's archive)
    <output>/model_repository/<name>/1/model_lora.onnx   adapters: the graph with a LoRA branch beside each projection,
    <output>/model_repository/<name>/1/adapters/         naming the base graph's weights file, and each adapter per
                                                         site (compiler/lora/package.py, docs/lora.md); with
                                                         lora_scales.safetensors where AWQ scaled the base
    <output>/model_repository/<name>/1/manifest.json     RepositoryManifest: what the runtime reads
    <output>/model_repository/<name>/1/llmc/             llmc.runtime copied whole (no torch, no transformers)
    <output>/model_repository/<name>/requirements.txt    what the serving Python needs

Copying `model_repository/` to any Triton server whose Python has the requirements (or, with an
execution_env, any Triton container with that Python) is a deployment.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import shutil
from pathlib import Path
from typing import Mapping

import llmc
from llmc.compiler.artifacts import DraftArtifact, EngineModel, ExecutionEnvironment, ExportedModel, QuantizedModel
from llmc.compiler.lora.package import check_adapters_spec, package_adapters
from llmc.compiler.output import link_or_copy
from llmc.compiler.repository.chat_template import find_chat_template
from llmc.compiler.repository.tokenizer import write_tokenizer
from llmc.compiler.repository.triton_config import model_config, render
from llmc.compiler.source import SourceInfo, load_tokenizer
from llmc.compiler.spec import BuildSpec
from llmc.compiler.stage import Context, Located, Stage
from llmc.runtime.kernels import cpu_kernels
from llmc.runtime.manifest import (DraftModel, ExecutionEnvInfo, RepositoryManifest, ServingLimits,
                                   SpeculativeConfig)

REPOSITORY_DIR = "model_repository"  # the package stage's folder in the output
VERSION = "1"
DRAFT_DIR = "draft"  # the draft graph's folder in the version folder
TOKENIZER_FILE = "tokenizer.json"
RUNTIME_SOURCES = (".py", ".c", ".h")  # the runtime package's files: modules, the CPU kernel's C and headers


def requirements(tensorrt_version: str | None = None) -> list[str]:
    """The serving Python's packages: the exact runtime versions verified here (the engine's
    TensorRT for a TensorRT build); numpy 1 for the stub; llguidance for guided requests."""
    if tensorrt_version is None:
        # onnx: make_session swaps llmc's CPU kernel into 4-bit graphs (runtime/kernels/cpu_kernels.py)
        runtime = [f"onnxruntime=={importlib.metadata.version('onnxruntime')}",
                   f"onnx=={importlib.metadata.version('onnx')}"]
    else:
        runtime = [f"tensorrt=={tensorrt_version}", "cuda-python>=12.6"]
    # llguidance: structured output's grammars (runtime/decoding/grammar.py), the version the tests ran
    return ["numpy<2", *runtime, f"tokenizers=={importlib.metadata.version('tokenizers')}", "pydantic>=2.6",
            f"llguidance=={importlib.metadata.version('llguidance')}"]


def package(spec: BuildSpec, exported: ExportedModel, engine: ExportedModel | QuantizedModel | EngineModel,
            engine_dir: Path, source: SourceInfo, repo_dir: Path, draft: Located | None = None,
            environment: "Located[ExecutionEnvironment] | None" = None,
            export_dir: Path | None = None) -> RepositoryManifest:
    """Write the repository for `engine` (the export, its quantized form, or the TensorRT engine
    built from either) found in `engine_dir`. `spec` has its limits filled in (BuildSpec.with_model_limits;
    the build's BuildResult.spec). `draft` is the draft stage's DraftArtifact and folder
    (speculative.method draft). `export_dir`: the export's folder, where the LoRA sites are found (spec.adapters)."""
    assert spec.limits.max_seq_len is not None and spec.serving.default_max_tokens is not None, "unresolved limits"
    model_dir = repo_dir / spec.name
    version_dir = model_dir / VERSION
    version_dir.mkdir(parents=True)
    for name in engine.files:  # the graph and its external data side by side as ORT expects (in rank{r}/ when the
        (version_dir / name).parent.mkdir(exist_ok=True)  # model is split), or the plan
        link_or_copy(str(engine_dir / name), str(version_dir / name))
    tokenizer = load_tokenizer(source)
    chat = find_chat_template(source, spec.serving.chat_template, tokenizer, spec.serving.tool_call_format)
    write_tokenizer(tokenizer, version_dir / TOKENIZER_FILE, origin=str(source.path),
                    chat_template=chat.model_dump() if chat else None, check=spec.verify.enabled)
    draft_model = _copy_draft(draft, version_dir / DRAFT_DIR) if draft is not None else None
    env = _link_environment(environment, version_dir) if environment is not None else None
    lora = None
    if spec.adapters:
        assert export_dir is not None, "adapters are packaged with the export's folder (the sites' graph)"
        scales = engine.channel_scales if isinstance(engine, QuantizedModel) else None  # AWQ's, when it scaled
        lora = package_adapters(spec, source, export_dir / exported.onnx, engine_dir / engine.model_file,
                                engine.model_file, version_dir, engine_dir / scales if scales else None)
    copy_runtime(version_dir / "llmc")
    shutil.copyfile(importlib.resources.files("llmc.model_repository") / "model.py", version_dir / "model.py")
    tensorrt = engine.tensorrt if isinstance(engine, EngineModel) else None
    # KIND_GPU gives one instance per GPU: a split engine's one instance places its ranks on the GPUs itself
    (model_dir / "config.pbtxt").write_text(render(model_config(
        spec.name, gpu=tensorrt is not None and exported.tensor_parallel == 1,
        chat_template=chat.model_dump_json() if chat else None,
        max_beam_width=spec.serving.max_beam_width, adapters=[a.name for a in lora.adapters] if lora else None,
        execution_env=f"{VERSION}/{env.archive}" if env is not None else None)))
    (model_dir / "requirements.txt").write_text(
        "\n".join(requirements(tensorrt.version if tensorrt else None)) + "\n")
    limits, serving = spec.limits, spec.serving
    manifest = RepositoryManifest(
        name=spec.name, llmc_version=llmc.__version__, target=spec.target.value, model_file=engine.model_file,
        tokenizer=TOKENIZER_FILE, kv_layout=engine.kv_layout, vocab_size=exported.model.vocab_size,
        end_ids=exported.model.eos_token_ids, source_hash=exported.source_hash, tensorrt=tensorrt, chat_template=chat,
        speculative=SpeculativeConfig(**spec.speculative.model_dump(mode="json", exclude={"draft"}), draft=draft_model)
        if spec.speculative else None, execution_env=env, tensor_parallel=exported.tensor_parallel, lora=lora,
        limits=ServingLimits(max_batch_size=limits.max_batch_size, max_seq_len=limits.max_seq_len,
                             max_num_tokens=limits.max_num_tokens, max_queue_size=serving.max_queue_size,
                             default_max_tokens=serving.default_max_tokens, max_stop_words=serving.max_stop_words,
                             num_threads=serving.num_threads, prefix_caching=serving.prefix_caching,
                             itl_ratio=serving.itl_ratio if engine.kv_layout.paged else None,
                             max_beam_width=serving.max_beam_width,
                             kv_cache_tokens=(limits.kv_cache_tokens or limits.max_batch_size * limits.max_seq_len)
                             if engine.kv_layout.paged else None))
    manifest.save(version_dir)
    return manifest


def _copy_draft(draft: "Located[DraftArtifact]", dest: Path) -> DraftModel:
    """The draft graph's files into `dest` (flat: a graph and its external data stay side by side)."""
    art = draft.artifact
    dest.mkdir()
    names = [Path(name).name for name in art.files]
    assert len(set(names)) == len(names), f"draft files collide when flattened: {sorted(art.files)}"
    for name in art.files:
        link_or_copy(str(draft.folder / name), str(dest / Path(name).name))
    return DraftModel(model_file=f"{DRAFT_DIR}/{Path(art.onnx).name}", kv_layout=art.kv_layout, source=art.source,
                      source_hash=art.source_hash, quantization=art.quantization.value)


def _link_environment(environment: "Located[ExecutionEnvironment]", version_dir: Path) -> ExecutionEnvInfo:
    art = environment.artifact
    link_or_copy(str(environment.folder / art.archive), str(version_dir / art.archive))
    return ExecutionEnvInfo(archive=art.archive, python=art.python, interpreter=art.interpreter)


def copy_runtime(dest: Path) -> None:
    """`dest` becomes an `llmc` package holding the runtime package whole (every module and the CPU
    kernel's C sources, at any depth; no caches or build outputs: a test imports the copy alone), plus
    the CPU-kernel library built here, so a serving host of the same kind needs no compiler (it
    rebuilds from the source, or keeps ONNX Runtime's kernels, otherwise)."""
    runtime = Path(importlib.resources.files("llmc.runtime"))
    dest.mkdir(parents=True)
    shutil.copyfile(Path(llmc.__file__), dest / "__init__.py")
    shutil.copytree(runtime, dest / "runtime", ignore=_not_runtime_source, copy_function=shutil.copyfile)
    library = cpu_kernels.library()
    if library is not None:
        shutil.copyfile(library, dest / "runtime" / "kernels" / library.name)  # where cpu_kernels looks first


def _not_runtime_source(folder: str, names: list[str]) -> list[str]:
    """copytree's filter: caches, hidden folders and anything but source files stay behind."""
    def left(name: str) -> bool:
        if (Path(folder) / name).is_dir():
            return name == "__pycache__" or name.startswith(".")
        return Path(name).suffix not in RUNTIME_SOURCES
    return [name for name in names if left(name)]


# the package stage: the Triton model repository (links and small files: runs on every build)

def _skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    exported = done.get("export")
    if exported is not None and not exported.artifact.model.has_tokenizer:
        return "the checkpoint has no tokenizer, so there is no text to serve"
    return None


def _run(engine: Located, spec: BuildSpec, ctx: Context) -> RepositoryManifest:
    """The engine, else the quantized graph, else the export; the export's model, the draft and the
    environment stages' files (declared in `takes` and `reads`)."""
    return package(spec, ctx.done["export"].artifact, engine.artifact, engine.folder, ctx.source, ctx.out,
                   draft=ctx.done.get("draft"), environment=ctx.done.get("environment"),
                   export_dir=ctx.done["export"].folder)


def _summary(done: Located[RepositoryManifest]) -> str:
    m, limits, spec = done.artifact, done.artifact.limits, done.artifact.speculative
    if m.kv_layout.paged:
        kv = (f"{limits.max_batch_size} rows a step, a KV pool of {limits.kv_cache_tokens} tokens in blocks of "
              f"{m.kv_layout.block_size}, {limits.max_seq_len} tokens a request")
    else:
        kv = f"{limits.max_batch_size} KV slots x {limits.max_seq_len} tokens"
    drafting = f", draft {spec.draft.model_file}" if spec and spec.draft else ""
    speculating = f", speculative {spec.method} (k {spec.num_tokens}, up to {spec.max_batch} rows{drafting})" \
        if spec else ""
    adapters = f", {len(m.lora.adapters)} LoRA adapters ({m.lora.lora_file})" if m.lora else ""
    return f"{REPOSITORY_DIR}/{m.name}: {kv}, queue {limits.max_queue_size}{speculating}{adapters}"


PACKAGE = Stage("package", describe=lambda spec: "writing the Triton model repository",
                takes=("tensorrt", "quantize", "export"), reads=("draft", "environment"), folder=REPOSITORY_DIR,
                check=check_adapters_spec, skip=_skip, run=_run, summary=_summary)
