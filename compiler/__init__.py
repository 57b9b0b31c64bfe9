"""The build pipeline: spec -> export -> verify -> quantize -> engine (target: tensorrt) -> package.

Library API (the CLI only calls these):

    from llmc.compiler import load_spec, build, plan_build, export, verify, inspect_path
"""

from llmc.compiler.spec import BuildSpec, load_spec

__all__ = ["BuildSpec", "load_spec", "build", "plan_build", "export", "verify", "inspect_path"]


def __getattr__(name: str):
    # Stages import torch/onnx lazily so `llmc --help` and spec validation stay fast.
    if name == "build":
        from llmc.compiler.pipeline import build

        return build
    if name == "plan_build":
        from llmc.compiler.plan import plan_build

        return plan_build
    if name == "export":
        from llmc.compiler.export import export

        return export
    if name == "verify":
        from llmc.compiler.verify import verify

        return verify
    if name == "inspect_path":
        from llmc.compiler.inspect import inspect_path

        return inspect_path
    raise AttributeError(name)
