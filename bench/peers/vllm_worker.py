"""Runs vLLM's CPU build as a peer for bench/throughput.py, in bench/.venv-vllm (see setup_peers.sh).

Reads one JSON command per line on stdin and answers one JSON line on stdout, so the benchmark can
alternate between engines without paying vLLM's start-up each time:
  {"prompts": [[ids], ...], "max_tokens": 128}  ->  {"seconds": s, "output_tokens": n}
"""
import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = sys.argv[1]
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_num_seqs=64, seed=0,
              enable_prefix_caching=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=command["max_tokens"], ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in command["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}),
              flush=True)


if __name__ == "__main__":
    main()
