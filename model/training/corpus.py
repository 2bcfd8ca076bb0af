"""The bilingual training corpus of the "small" model: short, sensible classroom sentences.

Half Vietnamese, half English, built from templates and word lists over a few everyday domains (animals,
weather, family, food, school, daily routine, colours, numbers, places). Every template only combines
words that fit together (a cat eats fish, a rabbit eats carrots), so that a tiny word-level model
trained on it writes sentences that make sense.

Format, chosen for the app's tokenizer (NFC, lowercase, `Whitespace` pre-tokenizer): lowercase words
separated by single spaces, punctuation as its own token, every sentence ending in " .", " ?" or " !".
No apostrophes or hyphens, since they would split a word into several tokens. Vietnamese words stay
split into syllables ("con mèo" is two tokens), as Vietnamese is written.

Pure standard library, deterministic for a seed: `generate_corpus(seed)` always gives the same list.
"""

from __future__ import annotations

import random
import unicodedata
from collections import Counter
from collections.abc import Callable

Builder = Callable[[random.Random], str]

# the course's worked example, `micro`: 8 tokens and the four sentences it learns
MICRO_VOCAB = ["<pad>", "<bos>", "mèo", "ăn", "cá", "uống", "<eos>", "sữa"]
MICRO_SENTENCES = ["ăn cá", "mèo ăn cá", "uống sữa", "mèo uống sữa"]

# The first prompt of each language is the app's default; every prompt starts many corpus sentences.
EXAMPLE_PROMPTS = {
    "vi": ["con mèo", "hôm nay trời", "mẹ nấu", "em đi học", "con chó", "bữa sáng em ăn"],
    "en": ["the dog", "today the weather", "my mother cooks", "i go to school", "the cat",
           "for breakfast i eat"],
}

# Number words indexed by their value.
VI_NUMBERS = ["không", "một", "hai", "ba", "bốn", "năm", "sáu", "bảy", "tám", "chín", "mười",
              "mười một", "mười hai"]
EN_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
              "eleven", "twelve"]


def _sentence(*parts: str, end: str = ".") -> str:
    """Join phrases into one sentence: single spaces, the end mark as a separate token."""
    return " ".join([*" ".join(parts).split(), end])


def _pick(rng: random.Random, options: dict[str, list[str]]) -> tuple[str, str]:
    """A random key and one of its compatible values."""
    key = rng.choice(list(options))
    return key, rng.choice(options[key])


# --- animals -----------------------------------------------------------------------------------------

ANIMALS_VI = {
    "con mèo": ["ăn cá", "uống sữa", "bắt chuột", "ngủ trên ghế", "chơi với quả bóng", "chạy trong vườn"],
    "con chó": ["ăn thịt", "gặm xương", "chạy trong vườn", "sủa rất to", "canh nhà", "chơi với em"],
    "con gà": ["ăn thóc", "đẻ trứng", "gáy vào buổi sáng"],
    "con bò": ["ăn cỏ trên cánh đồng", "uống nước"],
    "con vịt": ["bơi trong ao", "ăn thóc"],
    "con cá": ["bơi trong ao", "bơi dưới sông"],
    "con chim": ["hót trên cây", "bay trên bầu trời", "làm tổ trên cây"],
    "con thỏ": ["ăn cà rốt", "ăn rau"],
    "con khỉ": ["ăn chuối", "leo cây"],
}
ANIMALS_EN = {
    "cat": ["eats fish", "drinks milk", "catches a mouse", "sleeps on the chair", "plays with a ball",
            "runs in the garden"],
    "dog": ["eats meat", "chews a bone", "runs in the garden", "barks loudly", "guards the house",
            "plays with me"],
    "chicken": ["eats grain", "lays eggs", "runs in the yard"],
    "cow": ["eats grass in the field", "drinks water"],
    "duck": ["swims in the pond", "eats grain"],
    "fish": ["swims in the pond", "swims in the river"],
    "bird": ["sings in the tree", "flies in the sky", "builds a nest in the tree"],
    "rabbit": ["eats carrots", "eats vegetables"],
    "monkey": ["eats bananas", "climbs the tree"],
}
# The prompts "con mèo", "con chó", "the cat", "the dog" should be frequent: pets come up more often.
PETS_VI = ["con mèo", "con chó"]
PETS_EN = ["cat", "dog"]
# Only animals a family keeps can be "ours"; wild ones cannot.
WILD_VI = {"con cá", "con chim", "con khỉ"}
WILD_EN = {"fish", "bird", "monkey"}


def animal_vi(rng: random.Random) -> str:
    animal = rng.choice(PETS_VI) if rng.random() < 0.3 else rng.choice(list(ANIMALS_VI))
    owner = "nhà em" if animal not in WILD_VI and rng.random() < 0.2 else ""
    return _sentence(animal, owner, rng.choice(ANIMALS_VI[animal]))


def animal_en(rng: random.Random) -> str:
    animal = rng.choice(PETS_EN) if rng.random() < 0.3 else rng.choice(list(ANIMALS_EN))
    owner = "my" if animal not in WILD_EN and rng.random() < 0.2 else "the"
    return _sentence(owner, animal, rng.choice(ANIMALS_EN[animal]))


# --- weather -----------------------------------------------------------------------------------------

WEATHER_VI = ["nắng", "mưa", "nóng", "lạnh", "mát", "đẹp", "có gió", "nhiều mây", "nắng và nóng",
              "mưa và lạnh", "lạnh và có gió", "rất nóng", "rất lạnh", "mưa to", "rất đẹp"]
WEATHER_EN = ["sunny", "rainy", "hot", "cold", "cool", "warm", "windy", "cloudy", "nice", "hot and sunny",
              "cold and rainy", "cold and windy", "very hot", "very cold", "warm and sunny"]
SEASONS_VI = {"mùa xuân": "ấm", "mùa hè": "nóng", "mùa thu": "mát", "mùa đông": "lạnh"}
SEASONS_EN = {"spring": "warm", "summer": "hot", "autumn": "cool", "winter": "cold"}
# What people do because of the weather: (weather, consequence).
WEATHER_REASONS_VI = [("mưa", "em mang áo mưa đi học"), ("lạnh", "em mặc áo ấm"),
                      ("nắng", "em đội mũ khi ra ngoài"), ("nóng", "em uống nhiều nước"),
                      ("đẹp", "cả nhà đi công viên")]
WEATHER_REASONS_EN = [("raining", "i take my raincoat to school"), ("cold", "i wear a warm coat"),
                      ("sunny", "i wear a hat"), ("hot", "i drink a lot of water"),
                      ("nice", "we go to the park")]


def weather_vi(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.5:
        # "hôm nay trời" is a prompt, so today comes up twice as often as yesterday or tomorrow.
        day = rng.choices(["hôm nay", "hôm qua", "ngày mai"], weights=[2, 1, 1])[0]
        will = "sẽ" if day == "ngày mai" else ""
        return _sentence(day, "trời", will, rng.choice(WEATHER_VI))
    if kind < 0.7:
        season = rng.choice(list(SEASONS_VI))
        return _sentence(season, "trời", rng.choice(["", "rất"]), SEASONS_VI[season])
    if kind < 0.9:
        weather, consequence = rng.choice(WEATHER_REASONS_VI)
        return _sentence("trời", weather, "nên", consequence)
    if rng.random() < 0.5:
        return _sentence("hôm nay trời có", rng.choice(["mưa", "lạnh", "nóng"]), "không", end="?")
    return _sentence("hôm nay trời", rng.choice(["đẹp", "nóng", "lạnh"]), "quá", end="!")


def weather_en(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.5:
        tenses = [("today", "is"), ("yesterday", "was"), ("tomorrow", "will be")]
        day, verb = rng.choices(tenses, weights=[2, 1, 1])[0]
        return _sentence(day, "the weather", verb, rng.choice(WEATHER_EN))
    if kind < 0.7:
        season = rng.choice(list(SEASONS_EN))
        return _sentence("in", season, "the weather is", rng.choice(["", "very"]), SEASONS_EN[season])
    if kind < 0.9:
        weather, consequence = rng.choice(WEATHER_REASONS_EN)
        return _sentence("it is", weather, "so", consequence)
    if rng.random() < 0.5:
        return _sentence("is it", rng.choice(["rainy", "cold", "hot"]), "today", end="?")
    return _sentence("it is so", rng.choice(["nice", "hot", "cold"]), "today", end="!")


# --- family --------------------------------------------------------------------------------------------

FAMILY_VI = {
    "mẹ": ["đi chợ mua rau", "rửa bát", "quét nhà", "giặt quần áo"],
    "bố": ["đọc báo", "tưới cây", "uống cà phê"],
    "ông": ["uống trà", "đọc báo", "đi bộ trong công viên"],
    "bà": ["kể chuyện cho em nghe", "trồng rau trong vườn", "đi chợ mua cá"],
    "anh trai em": ["đá bóng với bạn", "làm bài tập", "rửa bát", "đọc sách"],
    "chị gái em": ["đọc sách", "giúp mẹ nấu cơm", "giặt quần áo", "quét nhà"],
}
FAMILY_EN = {
    "my mother": ["buys vegetables at the market", "washes the dishes", "cleans the house",
                  "washes the clothes"],
    "my father": ["reads the newspaper", "waters the plants", "drinks coffee"],
    "my grandfather": ["drinks tea", "reads the newspaper", "walks in the park"],
    "my grandmother": ["tells me a story", "grows vegetables in the garden", "buys fish at the market"],
    "my brother": ["plays football with his friends", "does his homework", "washes the dishes",
                   "reads a book"],
    "my sister": ["reads a book", "helps my mother cook", "washes the clothes", "cleans the house"],
}
# Who cooks for whom (nobody cooks for themselves), and how often each one cooks.
COOKS_VI = {"mẹ": ["cả nhà", "em", "bố", "ông bà"], "bà": ["cả nhà", "em"], "bố": ["cả nhà", "em", "mẹ"]}
COOKS_EN = {"my mother": ["the family", "us", "me", "my grandparents"],
            "my grandmother": ["the family", "me"], "my father": ["the family", "us", "my mother"]}
COOK_WEIGHTS = [3, 1, 1]
DISHES_VI = ["cơm", "canh", "phở", "cháo", "canh cá"]
DISHES_EN = ["rice", "soup", "noodle soup", "dinner", "breakfast", "fish soup"]


def family_vi(rng: random.Random) -> str:
    if rng.random() < 0.35:  # cooking is the most frequent family scene ("mẹ nấu" is a prompt)
        cook = rng.choices(list(COOKS_VI), COOK_WEIGHTS)[0]
        return _sentence(cook, "nấu", rng.choice(DISHES_VI), "cho", rng.choice(COOKS_VI[cook]))
    if rng.random() < 0.12:
        return _sentence("em rất yêu", rng.choice(["bố mẹ", "gia đình"]), "của em")
    return _sentence(*_pick(rng, FAMILY_VI))


def family_en(rng: random.Random) -> str:
    if rng.random() < 0.35:
        cook = rng.choices(list(COOKS_EN), COOK_WEIGHTS)[0]
        return _sentence(cook, "cooks", rng.choice(DISHES_EN), "for", rng.choice(COOKS_EN[cook]))
    if rng.random() < 0.12:
        return _sentence("i love my", rng.choice(["parents", "family"]), "very much")
    return _sentence(*_pick(rng, FAMILY_EN))


# --- food & drink ----------------------------------------------------------------------------------------

FOODS_VI = ["phở", "bánh mì", "cơm", "cá", "thịt gà", "rau", "trứng", "xôi"]
FOODS_EN = ["noodle soup", "bread", "rice", "fish", "chicken", "vegetables", "eggs", "bananas"]
# Children drink milk and juice, grown-ups tea and coffee.
DRINKERS_VI = {"em": ["sữa", "nước cam"], "bố": ["cà phê", "trà"], "mẹ": ["trà", "nước cam"], "ông": ["trà"]}
DRINKERS_EN = {"i": ["milk", "orange juice"], "my father": ["coffee", "tea"],
               "my mother": ["tea", "orange juice"], "my grandfather": ["tea"]}
FRUIT_TASTE_VI = [("quả chuối", "ngọt"), ("quả xoài", "ngọt"), ("quả chanh", "chua")]
FRUIT_TASTE_EN = [("banana", "sweet"), ("mango", "sweet"), ("lemon", "sour")]


def food_vi(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.25:  # breakfast: "bữa sáng em ăn" is a prompt
        food = rng.choice(["bánh mì", "phở", "xôi", "cháo", "trứng"])
        return _sentence("bữa sáng em ăn", food, "và uống", rng.choice(["sữa", "nước cam"]))
    if kind < 0.4:
        return _sentence(rng.choice(["em", "bố", "mẹ", "anh trai em"]), "thích ăn", rng.choice(FOODS_VI))
    if kind < 0.55:
        person, drink = _pick(rng, DRINKERS_VI)
        return _sentence(person, "uống", drink, "mỗi sáng")
    if kind < 0.63:
        return _sentence("em ăn cơm với", rng.choice(["cá", "thịt gà", "rau", "trứng"]))
    if kind < 0.8:
        fruit, taste = rng.choice(FRUIT_TASTE_VI)
        return _sentence(fruit, "rất", taste)
    if kind < 0.9:
        return _sentence(rng.choice(["phở", "bánh mì", "cơm"]), "ở đây rất ngon")
    return _sentence("bạn có thích ăn", rng.choice(["phở", "bánh mì", "cá"]), "không", end="?")


def food_en(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.25:
        food = rng.choice(["bread", "noodle soup", "rice", "eggs"])
        return _sentence("for breakfast i eat", food, "and drink", rng.choice(["milk", "orange juice"]))
    if kind < 0.4:
        person, verb = rng.choice([("i", "like"), ("my father", "likes"), ("my mother", "likes"),
                                   ("my brother", "likes")])
        return _sentence(person, verb, rng.choice(FOODS_EN))
    if kind < 0.55:
        person, drink = _pick(rng, DRINKERS_EN)
        return _sentence(person, "drink" if person == "i" else "drinks", drink, "every morning")
    if kind < 0.63:
        return _sentence("i eat rice with", rng.choice(["fish", "chicken", "vegetables", "eggs"]))
    if kind < 0.8:
        fruit, taste = rng.choice(FRUIT_TASTE_EN)
        return _sentence("the", fruit, "is very", taste)
    if kind < 0.9:
        return _sentence("the", rng.choice(["noodle soup", "bread", "rice"]), "here is very good")
    return _sentence("do you like", rng.choice(["noodle soup", "bread", "fish"]), end="?")


# --- school ----------------------------------------------------------------------------------------------

SUBJECTS_VI = ["toán", "tiếng việt", "tiếng anh", "âm nhạc", "mĩ thuật", "khoa học"]
SUBJECTS_EN = ["maths", "vietnamese", "english", "music", "art", "science"]
SCHOOL_VI = ["cô giáo giảng bài cho chúng em", "thầy giáo viết lên bảng", "chúng em học bài trong lớp",
             "chúng em đọc sách ở thư viện", "giờ ra chơi chúng em đá cầu", "em làm bài tập về nhà",
             "em mang sách vở đến trường", "em chơi với bạn ở sân trường"]
SCHOOL_EN = ["the teacher explains the lesson to us", "the teacher writes on the board",
             "we study in the classroom", "we read books in the library", "at break time we play football",
             "i do my homework", "i bring my books to school", "i play with my friends in the schoolyard"]


def school_vi(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.3:
        return _sentence("em thích học môn", rng.choice(SUBJECTS_VI))
    if kind < 0.45:
        return _sentence("cô giáo dạy chúng em môn", rng.choice(SUBJECTS_VI))
    return _sentence(rng.choice(SCHOOL_VI))


def school_en(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.3:
        return _sentence("i like", rng.choice(SUBJECTS_EN))
    if kind < 0.45:
        return _sentence("the teacher teaches us", rng.choice(SUBJECTS_EN))
    return _sentence(rng.choice(SCHOOL_EN))


# --- daily routine --------------------------------------------------------------------------------------

# (activity, part of the day, hours that make sense for it); "em" is the pupil speaking.
ROUTINE_VI = [("thức dậy", "sáng", [5, 6]), ("ăn sáng", "sáng", [6, 7]), ("đi học", "sáng", [6, 7]),
              ("ăn trưa", "trưa", [11, 12]), ("về nhà", "chiều", [4, 5]), ("ăn tối", "tối", [6, 7]),
              ("làm bài tập", "tối", [7, 8]), ("đi ngủ", "tối", [9, 10])]
PARENT_ROUTINE_VI = [("thức dậy", "sáng", [5, 6]), ("đi làm", "sáng", [7, 8]), ("về nhà", "chiều", [4, 5])]
ROUTINE_EN = [("get up", "morning", [5, 6]), ("have breakfast", "morning", [6, 7]),
              ("go to school", "morning", [6, 7]), ("come home", "afternoon", [4, 5]),
              ("have dinner", "evening", [6, 7]), ("do my homework", "evening", [7, 8]),
              ("go to bed", "evening", [9, 10])]
PARENT_ROUTINE_EN = [("gets up", "morning", [5, 6]), ("goes to work", "morning", [7, 8]),
                     ("comes home", "afternoon", [4, 5])]
HABITS_VI = ["em đánh răng rồi rửa mặt", "sau khi ăn sáng , em đi học", "sau giờ học , em chơi với bạn",
             "buổi tối em làm bài tập rồi đi ngủ"]
HABITS_EN = ["i brush my teeth and wash my face", "after breakfast , i go to school",
             "after school , i play with my friends", "in the evening i do my homework and go to bed"]


def routine_vi(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.55:
        activity, part, hours = rng.choice(ROUTINE_VI)
        return _sentence("em", activity, "lúc", VI_NUMBERS[rng.choice(hours)], "giờ", part)
    if kind < 0.75:
        activity, part, hours = rng.choice(PARENT_ROUTINE_VI)
        parent = rng.choice(["bố", "mẹ"])
        return _sentence(parent, activity, "lúc", VI_NUMBERS[rng.choice(hours)], "giờ", part)
    return _sentence(rng.choice(HABITS_VI))


def routine_en(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.55:
        activity, part, hours = rng.choice(ROUTINE_EN)
        return _sentence("i", activity, "at", EN_NUMBERS[rng.choice(hours)], "in the", part)
    if kind < 0.75:
        activity, part, hours = rng.choice(PARENT_ROUTINE_EN)
        parent = rng.choice(["my father", "my mother"])
        return _sentence(parent, activity, "at", EN_NUMBERS[rng.choice(hours)], "in the", part)
    return _sentence(rng.choice(HABITS_EN))


# --- colours ------------------------------------------------------------------------------------------------

COLOURS_VI = ["đỏ", "vàng", "xanh", "trắng", "đen", "hồng", "tím", "nâu"]
COLOURS_EN = ["red", "yellow", "blue", "green", "white", "black", "pink", "purple", "brown"]
# Things whose colour is a fact, and things that can be any colour.
NATURAL_COLOURS_VI = [("lá cây", "xanh"), ("bầu trời", "xanh"), ("đám mây", "trắng"), ("quả cà chua", "đỏ"),
                      ("quả chuối", "vàng"), ("sữa", "trắng")]
NATURAL_COLOURS_EN = [("the leaves are", "green"), ("the sky is", "blue"), ("the clouds are", "white"),
                      ("the tomato is", "red"), ("the banana is", "yellow"), ("milk is", "white")]
THINGS_VI = ["chiếc áo", "chiếc mũ", "chiếc xe đạp", "chiếc cặp"]
THINGS_EN = ["shirt", "hat", "bike", "school bag"]


def colour_vi(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        thing, colour = rng.choice(NATURAL_COLOURS_VI)
        return _sentence(thing, "màu", colour)
    if kind < 0.55:
        return _sentence(rng.choice(THINGS_VI), "của em màu", rng.choice(COLOURS_VI))
    if kind < 0.75:
        return _sentence("em có một", rng.choice(THINGS_VI), "màu", rng.choice(COLOURS_VI))
    if kind < 0.9:
        return _sentence("màu yêu thích của em là màu", rng.choice(COLOURS_VI))
    return _sentence(rng.choice(THINGS_VI), "của bạn màu gì", end="?")


def colour_en(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return _sentence(*rng.choice(NATURAL_COLOURS_EN))
    if kind < 0.55:
        return _sentence("my", rng.choice(THINGS_EN), "is", rng.choice(COLOURS_EN))
    if kind < 0.75:
        colour = rng.choice(COLOURS_EN)
        return _sentence("i have a", colour, rng.choice(THINGS_EN))
    if kind < 0.9:
        return _sentence("my favourite colour is", rng.choice(COLOURS_EN))
    return _sentence("what colour is your", rng.choice(THINGS_EN), end="?")


# --- numbers ------------------------------------------------------------------------------------------------

COUNTABLE_VI = ["con mèo", "con chó", "con gà", "con cá"]
COUNTABLE_EN = ["cats", "dogs", "chickens", "fish"]  # plural forms
FACTS_VI = ["một tuần có bảy ngày", "một năm có mười hai tháng"]
FACTS_EN = ["a week has seven days", "a year has twelve months"]


def _sum_or_difference(rng: random.Random) -> tuple[int, str, int, int]:
    """a + b = c or a - b = c with every number between one and ten."""
    if rng.random() < 0.5:
        a = rng.randint(1, 9)
        b = rng.randint(1, 10 - a)
        return a, "+", b, a + b
    a = rng.randint(2, 10)
    b = rng.randint(1, a - 1)
    return a, "-", b, a - b


def number_vi(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.25:
        a, op, b, c = _sum_or_difference(rng)
        return _sentence(VI_NUMBERS[a], "cộng" if op == "+" else "trừ", VI_NUMBERS[b], "bằng", VI_NUMBERS[c])
    if kind < 0.35:
        return _sentence("nhà em có", VI_NUMBERS[rng.randint(3, 6)], "người")
    if kind < 0.6:
        # "con mèo" already holds the classifier "con": "hai con mèo".
        return _sentence("em có", VI_NUMBERS[rng.randint(2, 5)], rng.choice(COUNTABLE_VI))
    if kind < 0.75:
        return _sentence("em năm nay", VI_NUMBERS[rng.randint(6, 10)], "tuổi")
    if kind < 0.85:
        return _sentence("lớp em có", rng.choice(["ba", "bốn"]), "mươi bạn")
    return _sentence(rng.choice(FACTS_VI))


def number_en(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.25:
        a, op, b, c = _sum_or_difference(rng)
        return _sentence(EN_NUMBERS[a], "plus" if op == "+" else "minus", EN_NUMBERS[b], "is", EN_NUMBERS[c])
    if kind < 0.35:
        return _sentence("there are", EN_NUMBERS[rng.randint(3, 6)], "people in my family")
    if kind < 0.6:
        return _sentence("i have", EN_NUMBERS[rng.randint(2, 5)], rng.choice(COUNTABLE_EN))
    if kind < 0.75:
        return _sentence("i am", EN_NUMBERS[rng.randint(6, 10)], "years old")
    if kind < 0.85:
        return _sentence("there are", rng.choice(["thirty", "forty"]), "pupils in my class")
    return _sentence(rng.choice(FACTS_EN))


# --- places & travel ------------------------------------------------------------------------------------

# (who, where they go, how they can get there)
TRIPS_VI = [("em", "đi học", ["xe đạp", "xe buýt"]), ("bố", "đi làm", ["xe máy"]),
            ("mẹ", "đi chợ", ["xe đạp"]), ("cả nhà", "về quê", ["ô tô", "xe buýt"]),
            ("gia đình em", "đi du lịch", ["máy bay", "tàu hỏa"])]
TRIPS_EN = [("i go", "to school", ["bike", "bus"]), ("my father goes", "to work", ["motorbike"]),
            ("my mother goes", "to the market", ["bike"]), ("we go", "to the countryside", ["car", "bus"]),
            ("my family travels", "", ["plane", "train"])]
OUTINGS_VI = {"cuối tuần": ["công viên", "sở thú"], "mùa hè": ["biển"]}
OUTINGS_EN = {"on the weekend": ["the park", "the zoo"], "in summer": ["the beach"]}
CITIES_VI = ["hà nội", "huế", "đà nẵng"]
CITIES_EN = ["hanoi", "hue", "da nang"]
PLACE_FACTS_VI = ["hà nội là thủ đô của việt nam", "ở sở thú có nhiều con vật",
                  "trong công viên có nhiều cây"]
PLACE_FACTS_EN = ["hanoi is the capital of vietnam", "there are many animals at the zoo",
                  "there are many trees in the park"]


def place_vi(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        who, where, vehicles = rng.choice(TRIPS_VI)
        return _sentence(who, where, "bằng", rng.choice(vehicles))
    if kind < 0.55:
        when, places = rng.choice(list(OUTINGS_VI.items()))
        return _sentence(when, ", gia đình em đi", rng.choice(places))
    if kind < 0.7:
        return _sentence("gia đình em sống ở", rng.choice(CITIES_VI))
    if kind < 0.85:
        return _sentence("nhà em ở gần", rng.choice(["trường", "chợ", "công viên"]))
    return _sentence(rng.choice(PLACE_FACTS_VI))


def place_en(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        who, where, vehicles = rng.choice(TRIPS_EN)
        return _sentence(who, where, "by", rng.choice(vehicles))
    if kind < 0.55:
        when, places = rng.choice(list(OUTINGS_EN.items()))
        return _sentence(when, ", my family goes to", rng.choice(places))
    if kind < 0.7:
        return _sentence("my family lives in", rng.choice(CITIES_EN))
    if kind < 0.85:
        return _sentence("my house is near the", rng.choice(["school", "market", "park"]))
    return _sentence(rng.choice(PLACE_FACTS_EN))


# Relative weight of each domain: chosen so that every word of the default corpus comes up often enough
# to be learnt, and the domains that hold most prompts (animals, weather, family) come up most.
DOMAINS: list[tuple[Builder, Builder, float]] = [
    (animal_vi, animal_en, 3.0),
    (weather_vi, weather_en, 2.0),
    (family_vi, family_en, 2.5),
    (food_vi, food_en, 1.75),
    (school_vi, school_en, 1.25),
    (routine_vi, routine_en, 1.5),
    (colour_vi, colour_en, 1.5),
    (number_vi, number_en, 1.5),
    (place_vi, place_en, 2.0),
]


def generate_corpus(seed: int = 0, n_sentences: int = 6000) -> list[str]:
    """`n_sentences` sentences, alternately Vietnamese and English, then shuffled; same seed, same list."""
    rng = random.Random(seed)
    weights = [w for _, _, w in DOMAINS]
    sentences = []
    for i in range(n_sentences):
        vi_builder, en_builder, _ = rng.choices(DOMAINS, weights)[0]
        builder = vi_builder if i % 2 == 0 else en_builder
        sentences.append(unicodedata.normalize("NFC", builder(rng)).lower())
    rng.shuffle(sentences)
    return sentences


def vocabulary(sentences: list[str]) -> list[str]:
    """Distinct words of `sentences`, most frequent first, ties in alphabetical order."""
    counts = Counter(word for sentence in sentences for word in sentence.split())
    return sorted(counts, key=lambda word: (-counts[word], word))
