""""a" or "an" before a GPU model's name, as it is read aloud: "an A100", "an H100", "an RTX A6000", "an L40S",
"a GeForce RTX 4090", "a T4". Initialisms are read letter by letter, so what counts is the sound of the first
letter's name (A, E, F, H, I, L, M, N, O, R, S, X start with a vowel sound); a word is read as a word.
"""
from __future__ import annotations

import re

VOWEL_SOUND_LETTERS = frozenset("AEFHILMNORSX")
# "a A100" / "a RTX A6000" / "a H100 SXM" in a sentence: an article before a name read letter by letter (a capital
# followed by a capital or a digit).
_WRONG_A = re.compile(r"\b([Aa]) (?=[AEFHILMNORSX][A-Z0-9])")


def article(name: str) -> str:
    word = name.strip().split(" ", 1)[0] if name.strip() else ""
    if not word:
        return "a"
    first = word[0]
    spelled = len(word) > 1 and (word[1].isupper() or word[1].isdigit())  # an initialism or a model number
    if spelled or len(word) == 1:
        return "an" if first.upper() in VOWEL_SOUND_LETTERS else "a"
    return "an" if first.lower() in "aeiou" else "a"


def with_article(name: str) -> str:
    return f"{article(name)} {name}"


def mend_articles(text: str) -> str:
    """Sentences stored before the policy chose its articles ("a A100 80GB SXM has 108") read right again."""
    return _WRONG_A.sub(lambda m: "An " if m.group(1) == "A" else "an ", text)
