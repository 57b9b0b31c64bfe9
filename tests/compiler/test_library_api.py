"""The library API the docs name (`from llmc.compiler import load_spec, build, plan_build, export, verify,
inspect_path`) gives the functions, whatever has been imported before."""

import importlib
import inspect
import pkgutil

import llmc.compiler

API = ("load_spec", "build", "plan_build", "export", "verify", "inspect_path")


def test_the_api_names_give_the_functions_after_every_submodule_is_imported():
    # a submodule's import binds its name on the package: one named like an API function would hide it
    for module in pkgutil.walk_packages(llmc.compiler.__path__, "llmc.compiler."):
        importlib.import_module(module.name)
    from llmc.compiler import build, export, inspect_path, load_spec, plan_build, verify

    for name, value in zip(API, (load_spec, build, plan_build, export, verify, inspect_path)):
        assert inspect.isfunction(value) and value.__name__ == name, (name, value)
        assert getattr(llmc.compiler, name) is value
    assert set(API) <= set(llmc.compiler.__all__)
