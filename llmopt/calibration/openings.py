"""The default calibration mix: first words for the documents `--calib self` has the model write.

A model that continues a random token writes whatever it writes most readily, mostly one kind of
English prose; GPTQ and AWQ then fit that and little else. Starting a share of the documents from
openings of other kinds (chat-templated dialogue, code, math, other languages) spreads the
calibration over what a model is used for, without shipping a data set. The openings are
llmopt's own text (the project's licence); the model writes the rest.

`MIX` is the share of documents of each kind; "random-token" keeps the data-free recipe's start
(one uniformly drawn token) for the rest. Dialogue openings are user turns rendered through the
model's own chat template when it has one, as "User: ...\nAssistant:" otherwise.
"""

from __future__ import annotations

RANDOM_TOKEN = "random-token"
DIALOGUE = "dialogue"

MIX: dict[str, float] = {
    RANDOM_TOKEN: 0.25,
    "prose": 0.20,
    DIALOGUE: 0.20,
    "code": 0.15,
    "math": 0.10,
    "languages": 0.10,
}

OPENINGS: dict[str, tuple[str, ...]] = {
    "prose": (
        "The river had been rising for three days when",
        "In the spring of 1887, the town council voted to",
        "Photosynthesis is the process by which",
        "The committee published its findings on Tuesday, noting that",
        "She had never trusted the old lighthouse keeper, but",
        "The history of the printing press begins",
        "Volcanic islands form when",
        "Dear Margaret,\n\nI write to you from",
        "Chapter 1\n\nThe morning train was late again, and",
        "Critics of the proposal argue that",
        "The recipe calls for two cups of flour,",
        "When the expedition finally reached the summit,",
    ),
    DIALOGUE: (
        "Can you explain how vaccines train the immune system?",
        "Write a short poem about autumn leaves.",
        "What is the difference between a list and a tuple in Python?",
        "I have a job interview tomorrow. Any advice?",
        "Summarize the causes of the French Revolution in a few sentences.",
        "How do I convert Celsius to Fahrenheit?",
        "My tomato plants have yellow leaves. What could be wrong?",
        "Translate 'good morning, how are you?' into Spanish.",
        "Why is the sky blue?",
        "Suggest three names for a small bakery.",
        "What are the pros and cons of electric cars?",
        "Help me plan a three-day trip to Rome.",
    ),
    "code": (
        "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
        "import os\nimport sys\n\n\ndef main():\n",
        "class Stack:\n    def __init__(self):\n",
        "#include <stdio.h>\n#include <stdlib.h>\n\nint main(int argc, char **argv) {\n",
        "function debounce(fn, delay) {\n",
        "SELECT customer_id, COUNT(*) AS orders\nFROM orders\n",
        "#!/bin/bash\nset -euo pipefail\n\n",
        "<!DOCTYPE html>\n<html>\n<head>\n",
        "public class Main {\n    public static void main(String[] args) {\n",
        "fn parse_line(line: &str) -> Option<(String, u32)> {\n",
        "# Compute the moving average of a time series\nimport numpy as np\n\n",
        "package main\n\nimport (\n\t\"fmt\"\n",
    ),
    "math": (
        "Problem: Find all real solutions of x^2 - 5x + 6 = 0.\nSolution:",
        "Let $f(x) = 3x^3 - 2x + 1$. Then $f'(x) =",
        "Theorem 1. For every prime p,",
        "A train travels 180 km in 2.5 hours. Its average speed is",
        "To compute the integral \\int_0^1 x e^x \\, dx, we integrate by parts:",
        "Question: What is 17 multiplied by 24?\nAnswer:",
        "The probability of rolling two sixes with two fair dice is",
        "Proof. Suppose, for contradiction, that",
        "Consider the matrix A = [[2, 1], [1, 3]]. Its eigenvalues",
        "If 3 notebooks cost $4.50, then 7 notebooks cost",
    ),
    "languages": (
        "Il était une fois, dans un petit village au bord de la mer,",
        "Die Stadt liegt am Ufer eines großen Sees und",
        "El sistema solar está formado por",
        "La cucina italiana è famosa in tutto il mondo per",
        "O Brasil é o maior país da América do Sul e",
        "Het weer in Nederland is vaak",
        "Москва — столица России и",
        "東京は日本の首都であり、",
        "北京是中国的首都，",
        "서울은 대한민국의 수도이며",
        "Bugün hava çok güzel, bu yüzden",
        "Warszawa jest stolicą Polski i",
    ),
}
