"""The prompt set the target answers to make a learned drafter's training data
(:mod:`verispec.training.data`).

:func:`chat_prompts` writes a deterministic, varied set of chat requests from templates and word lists
(explanations, advice, stories, comparisons, lists, e-mails, math word problems, code, translation) plus
summarization and question-answering requests over passages taken from the Python standard library's module
docstrings — text every Python installation carries. None of them is a bench prompt. :data:`FOLLOW_UPS` are
the second-turn requests that continue such a chat.
"""

from __future__ import annotations

import ast
import os
import random
import sys
from pathlib import Path

from verispec.errors import UsageError

__all__ = ["FOLLOW_UPS", "chat_prompts"]

_TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "volcanoes",
    "earthquakes",
    "the immune system",
    "vaccines",
    "climate change",
    "the stock market",
    "inflation",
    "compound interest",
    "credit scores",
    "the internet",
    "encryption",
    "machine learning",
    "neural networks",
    "blockchains",
    "electric cars",
    "solar panels",
    "wind turbines",
    "nuclear power",
    "the moon landing",
    "the Roman Empire",
    "the French Revolution",
    "the printing press",
    "ancient Egypt",
    "the Renaissance",
    "the Silk Road",
    "the human heart",
    "sleep",
    "meditation",
    "nutrition",
    "vitamins",
    "jet lag",
    "coffee",
    "tea",
    "bread baking",
    "composting",
    "honey bees",
    "whales",
    "octopuses",
    "rainforests",
    "deserts",
    "glaciers",
    "the ocean tides",
    "rainbows",
    "lightning",
    "magnets",
    "gravity",
    "the speed of light",
    "atoms",
    "DNA",
    "evolution",
    "dinosaurs",
    "the solar system",
    "Mars",
    "satellites",
    "GPS",
    "airplanes",
    "bicycles",
    "trains",
    "bridges",
    "skyscrapers",
    "recycling",
    "plastic pollution",
    "democracy",
    "taxes",
    "supply and demand",
    "remote work",
    "public speaking",
    "time management",
    "chess",
    "football",
    "the Olympic Games",
    "jazz",
    "classical music",
    "painting",
    "photography",
    "poetry",
    "libraries",
    "museums",
    "languages",
    "dictionaries",
    "maps",
    "clocks",
    "calendars",
    "batteries",
    "smartphones",
    "video games",
    "databases",
    "spreadsheets",
    "operating systems",
    "cloud computing",
)
_AUDIENCES = ("a ten-year-old", "a beginner", "my grandmother", "a busy manager", "a high-school student")
_ACTIVITIES = (
    "learn a new language",
    "save money each month",
    "start running",
    "sleep better",
    "cook for a family of four",
    "prepare for a job interview",
    "keep houseplants alive",
    "organize a small office",
    "learn to play guitar",
    "write a cover letter",
    "plan a birthday party",
    "study for an exam",
    "reduce screen time",
    "make new friends",
    "train a puppy",
    "start a vegetable garden",
    "pack for a week-long trip",
    "improve my handwriting",
    "learn to swim",
    "fix a flat bicycle tire",
    "paint a room",
    "negotiate a salary",
    "start a podcast",
    "keep a journal",
    "read more books",
    "move to a new city",
    "host a dinner party",
    "learn to code",
)
_THINGS = (
    "a lighthouse keeper",
    "a lost robot",
    "a dragon who is afraid of fire",
    "a small village by the sea",
    "a cat that can talk",
    "a time traveller",
    "a forgotten library",
    "a brave little boat",
    "an old clock",
    "a girl who collects clouds",
    "a baker and a giant",
    "a fox in the city",
    "the last tree on Earth",
    "a detective mouse",
    "a friendly ghost",
    "a snowman in summer",
    "two rival chefs",
    "a moon rabbit",
)
_PAIRS = (
    ("cats", "dogs"),
    ("tea", "coffee"),
    ("trains", "planes"),
    ("Python", "JavaScript"),
    ("renting", "buying a house"),
    ("books", "films"),
    ("summer", "winter"),
    ("cities", "the countryside"),
    ("email", "phone calls"),
    ("running", "swimming"),
    ("paper books", "e-readers"),
    ("solar power", "wind power"),
    ("SQL", "NoSQL databases"),
    ("working from home", "working in an office"),
    ("saving", "investing"),
    ("lists", "tuples in Python"),
)
_PEOPLE = ("my landlord", "a colleague", "my manager", "a customer", "my neighbour", "a teacher", "a hotel")
_REASONS = (
    "a broken heater",
    "a missed deadline",
    "a refund for a damaged order",
    "a schedule change",
    "thanking them for their help",
    "a noisy party",
    "booking a meeting room",
    "a late payment",
)
_CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text",
    "returns the largest element of a list",
    "merges two sorted lists",
    "computes a factorial",
    "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome",
    "returns the Fibonacci numbers below n",
    "reads a CSV file and sums a column",
    "finds the most common letter in a string",
    "validates an email address",
    "flattens a nested list",
    "computes the average of a list of numbers",
)
_SENTENCES = (
    "Where is the train station?",
    "I would like a cup of coffee, please.",
    "The weather is lovely today.",
    "My sister lives in a small town near the sea.",
    "Could you help me carry these boxes?",
    "We are going to the museum tomorrow morning.",
    "This book is more interesting than the film.",
    "Please close the window when you leave.",
    "How much does this jacket cost?",
    "I have been learning to cook for two years.",
)
_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")

_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Explain {topic} to {audience}.",
    "What is {topic}? Answer in three sentences.",
    "Give me five interesting facts about {topic}.",
    "Why is {topic} important?",
    "Write a short poem about {topic}.",
    "What are common misconceptions about {topic}?",
    "How do I {activity}?",
    "Give me some tips to {activity}.",
    "I want to {activity}. Where should I start?",
    "Make a step-by-step plan to {activity} in one month.",
    "Write a short story about {thing}.",
    "Tell me a bedtime story about {thing}.",
    "Compare {a} and {b}.",
    "What are the pros and cons of {a} versus {b}?",
    "Write a polite email to {person} about {reason}.",
    "Write a short message to {person} about {reason}.",
    "Write a Python function that {code}.",
    "How would you write a function that {code}? Explain your approach.",
    "Translate into {language}: {sentence}",
)


def _math_problem(rng: random.Random) -> str:
    """An arithmetic word problem with numbers drawn from ``rng``."""
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    return rng.choice(
        (
            f"A shop sells pencils at {c} dollars each. Anna buys {a} pencils and Ben buys {b}. "
            "How much do they spend in total?",
            f"A train travels {a * 10} kilometres in {c} hours. What is its average speed?",
            f"Tom has {a + b} apples. He gives {b} to his friends and buys {c} more. How many does he have?",
            f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
            f"There are {a} students in a class and {c} of them are absent. What fraction is present?",
        )
    )


def _stdlib_passages() -> list[str]:
    """Paragraphs of 40–160 words from the standard library's module docstrings, read without importing."""
    root = Path(os.__file__).parent
    passages = []
    for name in sorted(sys.stdlib_module_names):
        file = root / f"{name}.py"
        if not file.is_file():
            file = root / name / "__init__.py"
        try:
            doc = ast.get_docstring(ast.parse(file.read_text(encoding="utf-8")))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for paragraph in (doc or "").split("\n\n"):
            words = paragraph.split()
            if 40 <= len(words) <= 160 and paragraph.count(">>>") == 0:
                passages.append(" ".join(words))
    return passages


def chat_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct user requests (deterministic in ``seed``); see the module docstring."""
    if count < 1:
        raise UsageError(f"count must be >= 1, got {count}")
    rng = random.Random(seed)
    passages = _stdlib_passages()
    prompts: dict[str, None] = {}
    for _ in range(count * 50):
        if len(prompts) == count:
            break
        kind = rng.random()
        if kind < 0.1:
            prompts[_math_problem(rng)] = None
        elif kind < 0.25 and passages:
            passage = rng.choice(passages)
            request = rng.choice(
                (
                    "Summarize the following text in two sentences.",
                    "Summarize this passage for a beginner.",
                    "What is the main idea of this text?",
                    "Explain this documentation in plain words.",
                    "List the key points of this text.",
                )
            )
            prompts[f"{request}\n\n{passage}"] = None
        else:
            a, b = rng.choice(_PAIRS)
            fields = {
                "topic": rng.choice(_TOPICS),
                "audience": rng.choice(_AUDIENCES),
                "activity": rng.choice(_ACTIVITIES),
                "thing": rng.choice(_THINGS),
                "a": a,
                "b": b,
                "person": rng.choice(_PEOPLE),
                "reason": rng.choice(_REASONS),
                "code": rng.choice(_CODE_TASKS),
                "language": rng.choice(_LANGUAGES),
                "sentence": rng.choice(_SENTENCES),
            }
            prompts[rng.choice(_TEMPLATES).format(**fields)] = None
    if len(prompts) < count:
        raise UsageError(f"only {len(prompts)} distinct prompts can be made, {count} were asked for")
    return list(prompts)


FOLLOW_UPS = (  # second-turn requests that continue a chat (add_follow_ups)
    "Can you give me a concrete example?",
    "Summarize your answer in one sentence.",
    "Can you explain that more simply?",
    "What is the most important point?",
    "Thanks! Can you add two more tips?",
    "Rewrite that for a ten-year-old.",
    "What should I do first?",
    "Is there anything I should avoid?",
    "Make it shorter, please.",
    "Why is that?",
)
