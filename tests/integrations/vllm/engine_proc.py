"""A vLLM engine in its own process, driven by JSON lines: commands on stdin, one reply per
command on the file descriptor given by ``--reply-fd`` (vLLM's own logs stay on stdout/stderr).

Commands: ``{"op": "generate", "prompts": [[ids...]], "max_tokens": n}`` ->
``{"outputs": [{"tokens": [...], "logprobs": [[[id, lp], ...], ...], "cached": n, "s": t}]}``;
``{"op": "reset_prefix_cache"}``; ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--connector", default="", help="kv_connector_extra_config as JSON")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv_transfer = None
    if args.connector:
        kv_transfer = KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=json.loads(args.connector),
        )
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        block_size=32,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=0,
        kv_transfer_config=kv_transfer,
    )
    replies = os.fdopen(args.reply_fd, "w", buffering=1)
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in iter(input, None):
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset_prefix_cache":
            replies.write(json.dumps({"ok": bool(llm.reset_prefix_cache())}) + "\n")
            continue
        params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0, logprobs=3)
        outputs = []
        for ids in cmd["prompts"]:
            start = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            completion = out.outputs[0]
            outputs.append(
                {
                    "tokens": list(completion.token_ids),
                    "logprobs": [
                        sorted([tok, lp.logprob] for tok, lp in step.items())
                        for step in completion.logprobs or []
                    ],
                    "cached": out.num_cached_tokens,
                    "s": time.perf_counter() - start,
                }
            )
        replies.write(json.dumps({"outputs": outputs}) + "\n")


if __name__ == "__main__":
    main()
