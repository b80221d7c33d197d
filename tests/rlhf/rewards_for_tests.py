"""A reward function importable by path from a CLI run (the tests' own package is on its PYTHONPATH)."""


def says_the_word(prompts, completions, word, **_):
    return [float(w in c.lower()) for c, w in zip(completions, word)]


def even_tokens(prompts, completions, completion_ids, **_):
    """Any model, random weights too, earns different rewards with it: the share of even token ids."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]
