"""python -m llmc.bench NAME [ARGS] runs one benchmark; --list lists them by group."""

from __future__ import annotations

import sys

from llmc.bench import harness, registry


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.strip() + "\n\n" + registry.listing())
        return
    try:
        bench = registry.find(argv[0])
    except KeyError as err:
        raise SystemExit(f"python -m llmc.bench: {err.args[0]}") from None
    module = bench.load()
    parser = registry.parser(bench, module)
    args = parser.parse_args(argv[1:])
    print(harness.environment(), file=sys.stderr)
    try:
        module.run(args)
    except harness.UsageError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
