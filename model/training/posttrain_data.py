"""The post-training data the project makes itself (no download), bilingual, in corpus.py's spirit.

Two kinds, both built from corpus.py's own word lists, so that every word is in `small`'s vocabulary and every
answer is a sentence the pretrained model has seen the like of:

- SFT pairs (prompt, answer): a question the corpus never asks ("con mèo làm gì ?", "what is two plus three ?")
  and its answer as a corpus sentence ("con mèo bắt chuột .", "two plus three is five ."). For `smollm2` the
  English pairs go into its chat template instead (see `chat_pair`).
- Preference pairs (prompt, chosen, rejected): the same questions, the right answer against a wrong one (an
  action that belongs to another animal, a wrong sum, a vehicle that cannot make the trip). DPO learns from them
  directly; RLHF's reward model learns to score them.

`gemma3`, a base model that writes Vietnamese, gets its own SFT pairs instead (`gemma3_pairs`): general-knowledge
questions and sums in Vietnamese, in a plain "Hỏi: … / Đáp:" form, since a base model has no chat template.

Pure standard library, deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from model.training.corpus import ANIMALS_EN, ANIMALS_VI, EN_NUMBERS, TRIPS_VI, VI_NUMBERS, _sentence


@dataclass(frozen=True)
class SFTPair:
    prompt: str  # the question: its tokens get label -100, never learned
    answer: str  # the reply: the only tokens the loss counts
    lang: str    # "vi" | "en"


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str    # what a person would pick: the right answer
    rejected: str  # a wrong answer in the same form
    lang: str


def _animal_vi(rng: random.Random) -> tuple[str, str, str]:
    animal = rng.choice(list(ANIMALS_VI))
    wrong = [a for other, acts in ANIMALS_VI.items() for a in acts if a not in ANIMALS_VI[animal]]
    return (_sentence(animal, "làm gì", end="?"), _sentence(animal, rng.choice(ANIMALS_VI[animal])),
            _sentence(animal, rng.choice(wrong)))


def _animal_en(rng: random.Random) -> tuple[str, str, str]:
    animal = rng.choice(list(ANIMALS_EN))
    wrong = [a for other, acts in ANIMALS_EN.items() for a in acts if a not in ANIMALS_EN[animal]]
    return (_sentence("what does the", animal, "do", end="?"), _sentence("the", animal, rng.choice(ANIMALS_EN[animal])),
            _sentence("the", animal, rng.choice(wrong)))


def _sum_en(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(1, 9)
    b = rng.randint(1, 10 - a)
    wrong = rng.choice([c for c in range(1, 11) if c != a + b])
    question = _sentence("what is", EN_NUMBERS[a], "plus", EN_NUMBERS[b], end="?")
    return (question, _sentence(EN_NUMBERS[a], "plus", EN_NUMBERS[b], "is", EN_NUMBERS[a + b]),
            _sentence(EN_NUMBERS[a], "plus", EN_NUMBERS[b], "is", EN_NUMBERS[wrong]))


def _trip_vi(rng: random.Random) -> tuple[str, str, str]:
    who, where, vehicles = rng.choice(TRIPS_VI)
    wrong = [v for _, _, vs in TRIPS_VI for v in vs if v not in vehicles]
    return (_sentence(who, where, "bằng gì", end="?"), _sentence(who, where, "bằng", rng.choice(vehicles)),
            _sentence(who, where, "bằng", rng.choice(wrong)))


# (Vietnamese builders, English builders): the pairs alternate the two languages
BUILDERS = ([_animal_vi, _trip_vi], [_animal_en, _sum_en])


def _triples(seed: int, n: int):
    rng = random.Random(seed)
    for i in range(n):
        lang = "vi" if i % 2 == 0 else "en"
        yield lang, rng.choice(BUILDERS[i % 2])(rng)


def sft_pairs(seed: int = 0, n: int = 400) -> list[SFTPair]:
    return [SFTPair(q, right, lang) for lang, (q, right, _) in _triples(seed, n)]


def preference_pairs(seed: int = 0, n: int = 400) -> list[PreferencePair]:
    return [PreferencePair(q, right, wrong, lang) for lang, (q, right, wrong) in _triples(seed + 1, n)]


# questions the before/after view asks the model, greedy; none of them is asked word for word in the data's
# first pairs the page shows, but all are in the data's form
PROBE_PROMPTS = {"vi": ["con mèo làm gì ?", "bố đi làm bằng gì ?"],
                 "en": ["what does the dog do ?", "what is two plus three ?"]}
SMOLLM2_PROBES = ["What does a cat eat?", "What is two plus three?"]


# -- smollm2: English chat turns ------------------------------------------------------------------------------

SMOLLM2_ANIMALS = {"cat": "A cat eats fish and drinks milk.", "dog": "A dog eats meat and chews bones.",
                   "cow": "A cow eats grass in the field.", "rabbit": "A rabbit eats carrots.",
                   "monkey": "A monkey eats bananas.", "bird": "A bird eats seeds and worms.",
                   "duck": "A duck eats grain.", "chicken": "A chicken eats grain."}


def chat_pairs(seed: int = 0, n: int = 64) -> list[SFTPair]:
    """Short, fixed-form answers, so that the change after a few steps shows: "Answer: …" in one line."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        if i % 2 == 0:
            animal = rng.choice(list(SMOLLM2_ANIMALS))
            pairs.append(SFTPair(f"What does a {animal} eat?", "Answer: " + SMOLLM2_ANIMALS[animal], "en"))
        else:
            a = rng.randint(1, 9)
            b = rng.randint(1, 10 - a)
            pairs.append(SFTPair(f"What is {EN_NUMBERS[a]} plus {EN_NUMBERS[b]}?",
                                 f"Answer: {EN_NUMBERS[a]} plus {EN_NUMBERS[b]} is {EN_NUMBERS[a + b]}.", "en"))
    return pairs


# -- gemma3: a base model that continues Vietnamese text -------------------------------------------------------

GEMMA3_FORM = "Hỏi: {}\nĐáp:"  # no chat template: the form itself says where the answer starts
GEMMA3_FACTS = [
    ("Thủ đô của Việt Nam là thành phố nào?", "Thủ đô của Việt Nam là Hà Nội."),
    ("Thành phố đông dân nhất Việt Nam là thành phố nào?", "Thành phố Hồ Chí Minh."),
    ("Đỉnh núi cao nhất Việt Nam là đỉnh nào?", "Đỉnh Phan Xi Păng."),
    ("Hà Nội nằm ở miền nào của Việt Nam?", "Hà Nội nằm ở miền Bắc."),
    ("Quốc khánh Việt Nam là ngày nào?", "Ngày 2 tháng 9."),
    ("Một tuần có mấy ngày?", "Một tuần có bảy ngày."),
    ("Một năm có mấy tháng?", "Một năm có mười hai tháng."),
    ("Một ngày có bao nhiêu giờ?", "Một ngày có hai mươi bốn giờ."),
    ("Mặt Trời mọc ở hướng nào?", "Mặt Trời mọc ở hướng đông."),
    ("Con bò ăn gì?", "Con bò ăn cỏ."),
]
# one fact and one sum of the data; the sum's own question may be drawn or not, its form always is
GEMMA3_PROBES = [GEMMA3_FORM.format("Thủ đô của Việt Nam là thành phố nào?"),
                 GEMMA3_FORM.format("Ba cộng bốn bằng mấy?")]


def gemma3_pairs(seed: int = 0, n: int = 64) -> list[SFTPair]:
    """Vietnamese questions in GEMMA3_FORM, answered in one short sentence: a fact, or a sum up to ten in words."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        if i % 2 == 0:
            question, answer = rng.choice(GEMMA3_FACTS)
        else:
            a = rng.randint(1, 9)
            b = rng.randint(1, 10 - a)
            words = f"{VI_NUMBERS[a]} cộng {VI_NUMBERS[b]}"
            question, answer = f"{words.capitalize()} bằng mấy?", f"{words.capitalize()} bằng {VI_NUMBERS[a + b]}."
        pairs.append(SFTPair(GEMMA3_FORM.format(question), " " + answer, "vi"))
    return pairs


# each model's SFT pairs (a function of the seed) and the prompts its before/after view asks
SFT_DATA = {"small": (sft_pairs, PROBE_PROMPTS["vi"] + PROBE_PROMPTS["en"]),
            "smollm2": (chat_pairs, SMOLLM2_PROBES),
            "gemma3": (gemma3_pairs, GEMMA3_PROBES)}
CHAT_MODELS = ("smollm2",)  # the models whose prompts go into their chat template
