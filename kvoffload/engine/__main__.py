"""Run the reference engine against a running kvoffload service.

``python -m kvoffload.engine --endpoint ipc://... --prompts prompts.json [--out results.json]``

``prompts.json`` is a JSON list of prompts, each a list of token ids. The engine runs them in
order (greedy, ``--max-new-tokens``) and writes one JSON object per prompt (``Generation.to_dict``)
as a list to ``--out`` (default: stdout). Exit status 0 when every prompt ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from kvoffload.engine.model import TinyDecoder
from kvoffload.engine.scheduler import Engine
from kvoffload.engine.shapes import MODELS
from kvoffload.logs import configure_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload.engine", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--endpoint", required=True, help="client endpoint of the service")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument(
        "--cache-blocks", type=int, default=512, help="blocks of the paged KV cache"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--name", default=f"engine-{os.getpid()}")
    parser.add_argument("--logits", action="store_true", help="include every step's logits")
    parser.add_argument("--out", help="write the results here instead of stdout")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("engine", "warning")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = json.loads(Path(args.prompts).read_text())
    model = TinyDecoder(MODELS[args.model])
    with Engine.connect(model, args.endpoint, args.cache_blocks, args.name) as engine:
        results = [
            engine.generate(list(p), args.max_new_tokens).to_dict(args.logits) for p in prompts
        ]
    text = json.dumps(results)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
