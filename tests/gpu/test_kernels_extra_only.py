"""`pytest -m cuda tests/gpu tests/plugins` on a GPU machine that has only llmc's `kernels` extra (PyTorch,
Triton and their dependencies, plus llmc's own) and the test runner: it collects without an error. Checked
here by hiding every other installed package from a child Python (each of its top-level modules set to None
in sys.modules, so `import openai` fails as on that machine and `importlib.util.find_spec` finds nothing),
then collecting those folders the way that machine would. A module-level import of the OpenAI client,
tritonclient, transformers or the build pipeline (jinja2, onnxscript) fails this test."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Besides llmc[kernels]: PyTorch, which the kernels launch from (not in the extra's list, since setup installs the
# CPU wheel first), the test runner, and the pairwise parametrization the kernel sweeps use at collection
# (tests/helpers.py all_pairs; carried to the GPU machine as a wheel).
ALSO_THERE = ("torch", "pytest", "allpairspy")

CHILD = r"""
import importlib.metadata as md
import sys

from packaging.requirements import Requirement


def closure(roots):
    # every distribution the roots need, following unconditional requirements (and the `kernels` extra of llmc)
    seen, todo = set(), [(name, "kernels" if name == "llmc" else "") for name in roots]
    while todo:
        name, extra = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # an optional dependency not installed here either
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo.append((req.name, ""))
    return seen


allowed = closure(["llmc", *sys.argv[1:]])
for module, dists in md.packages_distributions().items():
    if module not in sys.stdlib_module_names and not any(d.lower().replace("_", "-") in allowed for d in dists):
        sys.modules[module] = None  # an import of it fails; find_spec says it is absent
import pytest

sys.exit(pytest.main(["--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/gpu", "tests/plugins"]))
"""


def test_cuda_tests_collect_with_only_the_kernels_extra():
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # entry-point plugins of packages not there
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", CHILD, *ALSO_THERE], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "error" not in out.lower().split("collected")[-1], out[-4000:]
    assert "tests/gpu/test_kernels.py::" in out and "tests/gpu/test_paged_triton.py::" in out, out[-4000:]
