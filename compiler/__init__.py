"""The build pipeline: spec -> export -> verify -> quantize -> engine (target: tensorrt) -> package.

Library API (the CLI only calls these):

    from llmc.compiler import load_spec, build, plan_build, export, verify, inspect_path

The layout: spec/ (the spec and its sections), source.py (the checkpoint), stage.py (what a stage
declares), graph/ (export and verify) with the decoders it traces (models/: each family's decoder;
paged_decoder.py: the same decoders over paged KV; the graph records their module paths), quantize/, draft.py, tensorrt/ (the engine), repository/ (the
Triton model repository and the serving environment), pipeline/ (the table of stages, the build,
the plan); artifacts.py, hashing.py, output.py, textdata/ and inspect.py beside them. No module here
is named like an API function, so importing a module never hides one (tests/compiler/test_library_api.py).
"""

from llmc.compiler.spec import BuildSpec, load_spec

__all__ = ["BuildSpec", "load_spec", "build", "plan_build", "export", "verify", "inspect_path"]


def __getattr__(name: str):
    # Stages import torch/onnx lazily so `llmc --help` and spec validation stay fast.
    if name == "build":
        from llmc.compiler.pipeline.run import build

        return build
    if name == "plan_build":
        from llmc.compiler.pipeline.plan import plan_build

        return plan_build
    if name == "export":
        from llmc.compiler.graph.export import export

        return export
    if name == "verify":
        from llmc.compiler.graph.verify import verify

        return verify
    if name == "inspect_path":
        from llmc.compiler.inspect import inspect_path

        return inspect_path
    raise AttributeError(name)
