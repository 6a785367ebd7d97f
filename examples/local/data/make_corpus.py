#!/usr/bin/env python3
"""Writes corpus.txt, the quickstart's training text: short generated stories and arithmetic
facts in plain English, regular enough that a small GPT-2 visibly learns them in a couple of
minutes on a laptop CPU. Deterministic (seeded); stdlib only.

    python3 make_corpus.py > corpus.txt
"""
import random

rng = random.Random(20240520)
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen"]
NAMES = ["Ada", "Alan", "Grace", "Linus", "Barbara", "Edsger", "Donald", "Frances", "John", "Margaret"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "goat", "crow"]
PLACES = ["the garden", "the river", "the old mill", "the market", "the forest", "the hill"]
THINGS = ["an apple", "a lantern", "a map", "a small key", "a loaf of bread", "a red ball"]
FEELINGS = ["happy", "tired", "curious", "hungry", "brave", "quiet"]


def story():
    name, animal, place, thing = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(THINGS)
    feeling = rng.choice(FEELINGS)
    return (f"{name} walked to {place} with a {animal}. The {animal} was {feeling}. "
            f"At {place}, {name} found {thing}. {name} gave {thing} to the {animal}, "
            f"and the {animal} was {feeling} no more. Then {name} and the {animal} went home.")


def arithmetic():
    a, b = rng.randrange(10), rng.randrange(9)
    return f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."


def main():
    paragraphs = []
    for _ in range(1500):
        if rng.random() < 0.5:
            paragraphs.append(story())
        else:
            paragraphs.append(" ".join(arithmetic() for _ in range(4)))
    print("\n\n".join(paragraphs))


if __name__ == "__main__":
    main()
