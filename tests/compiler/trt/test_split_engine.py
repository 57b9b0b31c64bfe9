"""A TensorRT split model (parallel.tensor: 2) through the tensorrt stage, the package stage and the loader, up to the
TensorRT calls: one engine per rank graph in rank{r}/model.plan, each built from its own rank's prepared graph with
its collectives expected and the rank's KV heads in its profiles (build_engine stands in for TensorRT, which the
loaders' own tests cover); the manifest lists every rank's engine; the repository is one instance that places its
ranks itself; the loader serves it with TrtTensorParallelRunner; the stage refuses to verify on too few GPUs. The real
2-GPU build and run is tests/gpu/test_tensorrt_split_serving.py."""

import pytest

from shared_builds import build_reusing_export
from llmc.compiler.spec import parse_spec
from llmc.runtime.manifest import TensorRTInfo

LIMITS = {"max_batch_size": 2, "max_seq_len": 64, "max_num_tokens": 32}


def _spec(source, **changes):
    return parse_spec({"name": "tiny-tp", "source": str(source), "target": "tensorrt", "precision": "fp32",
                       "parallel": {"tensor": 2}, "limits": LIMITS, "serving": {"default_max_tokens": 8},
                       "verify": {"enabled": False}, **changes})


@pytest.fixture(scope="module")
def split_engine(tiny_checkpoints, tmp_path_factory):
    """The stage run over the tiny Llama's split plugin export, each rank's build recorded."""
    from llmc.compiler.tensorrt import engine as trt_engine
    from llmc.compiler.tensorrt import stage

    out = tmp_path_factory.mktemp("tp_trt")
    result = build_reusing_export(tmp_path_factory, _spec(tiny_checkpoints["llama"]), out / "out", until="export")
    builds = []

    def build_engine(onnx_path, profiles, options, precision, out_dir, timing_cache=None, progress=None,
                     collectives=()):
        builds.append(dict(onnx=onnx_path, profiles=profiles, out=out_dir, collectives=list(collectives),
                           prepared=onnx_path.is_file()))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "model.plan").write_bytes(f"engine of {out_dir.name}".encode())
        return TensorRTInfo(version="11.4.0", gpu="NVIDIA H100", compute_capability="9.0",
                            hardware_compatibility="none", version_compatible=False, precision=precision,
                            profiles={p.name: {} for p in profiles})

    patch = pytest.MonkeyPatch()
    patch.setattr(trt_engine, "build_engine", build_engine)
    try:
        engine = stage.make_engine(result.exported, out / "out" / "export", result.exported, result.spec,
                                   out / "engine", inputs_hash="key", source_hash="s",
                                   load_model=lambda: pytest.fail("verify is off: no model to load"))
    finally:
        patch.undo()
    return result, engine, builds, out


def test_each_rank_graph_becomes_its_own_engine_with_its_collectives_and_kv_heads(split_engine):
    from llmc.compiler.artifacts import EngineModel

    result, engine, builds, out = split_engine
    exported, layers = result.exported, result.exported.model.num_layers
    assert [b["onnx"] for b in builds] == [out / "engine" / f"rank{r}" / "prepared" / "model.onnx" for r in (0, 1)]
    assert all(b["prepared"] for b in builds) and not (out / "engine" / "rank0" / "prepared").exists()
    for rank, b in enumerate(builds):  # the rank's own graph: its collectives carry its rank's group
        ops = [c["collective_operation"] for c in b["collectives"]]
        assert ops == [b"all_reduce"] * 2 * layers + [b"all_gather"] and {c["nb_rank"] for c in b["collectives"]} == {2}
        decode = {p.name: p for p in b["profiles"]}["decode"].shapes["past_key_values.*"]
        assert decode[2] == (2, exported.kv_layout.num_kv_heads, 64, exported.model.head_dim)
    assert exported.kv_layout.num_kv_heads * 2 == exported.model.num_kv_heads  # the profiles hold a rank's share
    assert engine.tensor_parallel == 2 and sorted(engine.files) == ["rank0/model.plan", "rank1/model.plan"]
    assert engine.plans(out / "engine") == [out / "engine" / "rank0" / "model.plan",
                                            out / "engine" / "rank1" / "model.plan"]
    assert (out / "engine" / "rank1" / "model.plan").read_bytes() == b"engine of rank1"
    assert EngineModel.load_cached(out / "engine", "key") == engine
    assert engine.kv_layout.in_place and engine.kv_layout.num_kv_heads == exported.kv_layout.num_kv_heads
    from llmc.compiler.tensorrt.stage import summary

    assert summary(engine).startswith("model.plan x 2 ranks (rank{r}/): TensorRT 11.4.0")


def test_the_repository_lists_every_rank_engine_and_the_loader_serves_them_together(split_engine, monkeypatch):
    from llmc.compiler.repository.package import package
    from llmc.compiler.repository.triton_config import parse
    from llmc.compiler.source import inspect_source
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.runners.parallel import trt_group as trt_tensor_parallel
    from llmc.runtime.serving import loader

    result, engine, _, out = split_engine
    manifest = package(result.spec, result.exported, engine, out / "engine", inspect_source(result.spec.source),
                       out / "repo")
    version = out / "repo" / "tiny-tp" / "1"
    assert manifest.tensor_parallel == 2 and manifest.target == "tensorrt" and manifest.model_file == "model.plan"
    assert manifest.graphs(version) == [version / "rank0" / "model.plan", version / "rank1" / "model.plan"]
    assert [p.read_bytes() for p in manifest.graphs(version)] == [b"engine of rank0", b"engine of rank1"]
    config = parse((version.parent / "config.pbtxt").read_text())  # one instance (KIND_GPU: one per GPU)
    assert [(g.kind, g.count) for g in config.instance_group] == [(config.instance_group[0].KIND_CPU, 1)]
    made = []

    class Runner:
        def __init__(self, engines, layout, **options):
            made.append((list(engines), layout, options))
            self.layout, self.rows, self.capacity = layout, options["max_batch"], options["capacity"]

        def close(self):
            made.append("closed")

    monkeypatch.setattr(trt_tensor_parallel, "TrtTensorParallelRunner", Runner)
    served, _, _ = loader.load(version)
    engines, layout, options = made[0]
    assert engines == manifest.graphs(version) and layout == RepositoryManifest.load(version).kv_layout
    assert options == dict(max_batch=2, capacity=64, max_num_tokens=32, info=engine.tensorrt)
    assert served.runner.rows == 2
    served.close()
    assert made[-1] == "closed"


def test_the_k8s_pod_of_a_split_tensorrt_model_asks_for_a_gpu_per_rank():
    from llmc.fleet.k8s import K8sOptions, triton_container

    opts = K8sOptions(name="tiny-tp", repository="s3://b/r", target="tensorrt", gpu=True, ranks=2, cpu="4")
    assert triton_container(opts, "/models")["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_the_stage_refuses_to_verify_a_split_on_fewer_gpus_than_ranks(tiny_checkpoints, monkeypatch):
    import torch

    from llmc.compiler.tensorrt import stage
    from llmc.errors import UnsupportedError

    monkeypatch.setattr(stage, "tensorrt_missing", lambda: None)
    monkeypatch.setattr(stage, "NEEDED_MODULES", ())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UnsupportedError, match=r"parallel.tensor: 2: .*2 rank engines together.*this machine has 1.*"
                                               r"verify.enabled: false"):
        stage.check(_spec(tiny_checkpoints["llama"], verify={"enabled": True}))
    stage.check(_spec(tiny_checkpoints["llama"]))  # verify off: the ranks are only built
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    stage.check(_spec(tiny_checkpoints["llama"], verify={"enabled": True}))


def test_the_verify_stage_leaves_a_split_plugin_graph_to_the_engine_stage(tiny_checkpoints):
    from llmc.compiler.graph.verify import VERIFY

    reason = VERIFY.skip(_spec(tiny_checkpoints["llama"], verify={"enabled": True}), {})
    assert reason == ("the plugin graph runs on TensorRT only; the tensorrt stage checks the engine (2 rank engines run "
                      "together) against ONNX Runtime")
