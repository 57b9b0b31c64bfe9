"""The README's family table lists every family and model type the registry claims (it cannot go stale)."""

import re

from checkpoints import REPO
from llmc.compiler.models import FAMILIES


def test_the_readme_table_names_every_family_and_model_type():
    table = (REPO / "README.md").read_text().split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): set(re.findall(r"`([a-z0-9_]+)`", m.group(2)))
            for m in re.finditer(r"^\| (\w+) \(([^)]*)\)", table, re.M)}
    rows.pop("family")  # the header
    assert rows == {f.name: set(f.model_types) for f in FAMILIES}
