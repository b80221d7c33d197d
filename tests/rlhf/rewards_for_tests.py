"""A reward function importable by path from a CLI run (the tests' own package is on its PYTHONPATH)."""


def says_the_word(prompts, completions, word, **_):
    return [float(w in c.lower()) for c, w in zip(completions, word)]
