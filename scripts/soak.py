"""Soak a build through a real Triton server: concurrent streams with cancellations and malformed
requests mixed in, then the reliability checks (llmc/soak.py).

    .venv/bin/python scripts/soak.py build/smollm2 [--streams 200] [--seconds 60] [--max-tokens 16]
    .venv/bin/python scripts/soak.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002

Prints the report and exits 1 when a check fails. With a build folder a server is started on free
ports and stopped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build_dir", nargs="?", type=Path)
    p.add_argument("--url", help="a running server's gRPC address instead of a build")
    p.add_argument("--metrics-url", help="its metrics endpoint (http://host:port), for the KV-in-use check")
    p.add_argument("--model")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--bad-fraction", type=float, default=0.1)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    if (args.build_dir is None) == (args.url is None):
        p.error("pass a build folder or --url (not both)")
    from llmc.soak import soak
    from llmc.serve import start_server

    server = start_server(args.build_dir, None, None, None, None) if args.url is None else None
    try:
        url = args.url or server.grpc_url
        metrics = args.metrics_url or (f"http://127.0.0.1:{server.ports.metrics}" if server else None)
        report = asyncio.run(soak(url, args.model, streams=args.streams, seconds=args.seconds,
                                  max_tokens=args.max_tokens, cancel_fraction=args.cancel_fraction,
                                  bad_fraction=args.bad_fraction, metrics_url=metrics))
    finally:
        if server is not None:
            server.stop()
    print("\n".join(report.lines()))
    print("PASS" if report.ok else "FAIL")
    if args.json:
        args.json.write_text(json.dumps({**asdict(report), "ok": report.ok}, indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
