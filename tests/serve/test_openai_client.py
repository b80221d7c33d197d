"""The server through the official `openai` client: chat and completions, streaming, logprobs, n > 1, seeds,
batches of prompts, best_of, response formats, tool messages, model cards."""
from __future__ import annotations

import math

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client, server):
    assert [m.id for m in client.models.list().data] == [server.model_name]


def test_chat_completion(client, server):
    response = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=12,
                                              temperature=0, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == server.model_name
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_streamed_chat_equals_the_whole_answer(client, server):
    options = dict(model=server.model_name, messages=MESSAGES, max_completion_tokens=20, temperature=0,
                   extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**options).choices[0].message.content
    chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for p in pieces if p) > 1, "the answer arrived in one piece, not streamed"
    assert "".join(pieces) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_completion_and_stream(client, server):
    options = dict(model=server.model_name, prompt="The weather today is", max_tokens=10, temperature=0,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**options)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(**options, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    echoed = client.completions.create(**options, echo=True).choices[0].text
    assert echoed == "The weather today is" + whole.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_do(client, server):
    """lm-evaluation-harness's loglikelihood: echo, logprobs, max_tokens 0 (or 1), offsets into the returned text."""
    prompt = "The capital of France is Paris"
    scored = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0)
    choice, logprobs = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert "".join(logprobs.tokens) == prompt and len(logprobs.tokens) == scored.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:]) and all(len(t) >= 1 for t in logprobs.top_logprobs[1:])
    assert all(prompt[at:].startswith(token) for at, token in zip(logprobs.text_offset, logprobs.tokens))
    generated = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=3, echo=True, logprobs=1,
                                          temperature=0, extra_body={"ignore_eos": True}).choices[0]
    both = generated.logprobs
    assert generated.text.startswith(prompt) and "".join(both.tokens) == generated.text
    assert len(both.tokens) == len(logprobs.tokens) + 3
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(both.token_logprobs[1:], logprobs.token_logprobs[1:]))
    assert all(generated.text[at:].startswith(token) for at, token in zip(both.text_offset, both.tokens))
    with pytest.raises(BadRequestError, match="max_tokens=0 generates nothing"):
        client.completions.create(model=server.model_name, prompt=prompt, max_tokens=0)


def test_a_completion_without_max_tokens_is_capped_by_the_context_left(client, server):
    context = client.models.retrieve(server.model_name).model_extra["max_model_len"]
    answer = client.completions.create(model=server.model_name, prompt=[7] * (context - 1), temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 1 and answer.choices[0].finish_reason == "length"
    assert client.completions.create(model=server.model_name, prompt="Hi", temperature=0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 16  # OpenAI's default


def test_chat_logprobs(client, server):
    response = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)
        assert entry.bytes == list(entry.token.encode())


def test_completion_logprobs(client, server):
    response = client.completions.create(model=server.model_name, prompt="One, two,", max_tokens=5, temperature=0,
                                         logprobs=2, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_n_samples_and_seeds(client, server):
    options = dict(model=server.model_name, messages=MESSAGES, max_tokens=16, temperature=1.0, n=3, seed=1234,
                   extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**options)
    again = client.chat.completions.create(**options)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices], "the same seed must give the same samples"
    assert len(set(texts)) > 1, "the n samples should differ"
    assert first.usage.completion_tokens == 48

    streamed = {}
    for chunk in client.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_stop_strings_cut_the_text(client, server):
    options = dict(model=server.model_name, prompt="Count: 1 2 3", max_tokens=24, temperature=0,
                   extra_body={"ignore_eos": True})
    text = client.completions.create(**options).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    cut = client.completions.create(**options, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**options, stop=[stop], stream=True)
                       if c.choices)
    assert streamed == cut.choices[0].text


def test_chat_answers_with_the_model_chat_template(client, server):
    """A multi-turn conversation with every role goes through the tokenizer's own template."""
    response = client.chat.completions.create(
        model=server.model_name, max_tokens=4, temperature=0,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": [{"type": "text", "text": "Again"}]}], user="tester")
    assert response.usage.prompt_tokens > 20  # the template's role markers are in the prompt


def test_models_retrieve(client, server):
    card = client.models.retrieve(server.model_name)
    assert card.id == server.model_name and card.object == "model"
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-17")


def test_a_batch_of_prompts_gets_n_choices_each(client, server):
    options = dict(model=server.model_name, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    texts = ["The sky is", "Numbers: 1, 2,", "Hello"]
    batch = client.completions.create(prompt=texts, n=2, **options)
    assert [c.index for c in batch.choices] == list(range(6))
    alone = [client.completions.create(prompt=t, **options).choices[0].text for t in texts]
    assert [c.text for c in batch.choices] == [a for a in alone for _ in range(2)]  # greedy: both samples agree
    assert batch.usage.completion_tokens == 6 * 4
    ids = client.completions.create(prompt=[[1, 2, 3], [4, 5]], **options)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    streamed = {}
    for chunk in client.completions.create(prompt=texts, stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == alone


def test_best_of_returns_the_most_likely_samples(client, server):
    options = dict(model=server.model_name, prompt="Once upon a time", max_tokens=6, seed=3,
                   extra_body={"ignore_eos": True})
    best = client.completions.create(best_of=4, n=1, **options)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 4 * 6  # every sample was generated
    every = client.completions.create(n=4, logprobs=0, **options)  # the same seed: the same four samples

    def mean(choice) -> float:
        return sum(choice.logprobs.token_logprobs) / len(choice.logprobs.token_logprobs)

    assert best.choices[0].text == max(every.choices, key=mean).text


def test_response_format_text_and_tool_messages_are_accepted(client, server):
    answer = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=3,
                                            response_format={"type": "text"})
    assert answer.choices[0].message.content is not None
    with pytest.raises(BadRequestError, match="constrained decoding"):
        client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=3,
                                       response_format={"type": "json_object"})
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "colours"}'}}
    conversation = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "red, green, blue"}]
    answer = client.chat.completions.create(model=server.model_name, messages=conversation, max_tokens=3)
    assert answer.choices[0].finish_reason == "length"
