"""Exact-match accuracy on the question set shipped beside this module (questions.json).

60 short questions, 20 each of facts, arithmetic and extraction from a given sentence, each with
its accepted answers. Each is asked in the model's chat template with an instruction to answer
with the answer only, and answered greedily. The answer is the response's first non-empty line;
it is right when, normalised, it equals a normalised accepted answer. Normalising lower-cases,
deletes ASCII punctuation ("$12." -> "12", "o'clock" -> "oclock"), drops the words a, an and the,
and collapses whitespace. A sentence around the answer ("The capital is Paris.") counts as wrong:
exact match rewards a model that follows the instruction, in every configuration alike.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from pathlib import Path

from tokenmill import LLM, SamplingParams

QUESTIONS_FILE = Path(__file__).with_name("questions.json")
INSTRUCTION = "Answer with only the answer: a single word, name or number, with no sentence."
MAX_ANSWER_TOKENS = 24
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


@dataclass(frozen=True, slots=True)
class Question:
    kind: str  # fact, arithmetic or extraction
    question: str
    answers: tuple[str, ...]


def load_questions(max_questions: int | None = None) -> list[Question]:
    """The set in file order, or `max_questions` of it taken evenly across the file."""
    items = json.loads(QUESTIONS_FILE.read_text())
    questions = [Question(i["kind"], i["question"], tuple(i["answers"])) for i in items]
    if max_questions is None or max_questions >= len(questions):
        return questions
    if max_questions < 1:
        raise ValueError(f"invalid eval option max_questions={max_questions}: must be >= 1")
    step = len(questions) / max_questions  # every kind stays represented in a small slice
    return [questions[int(i * step)] for i in range(max_questions)]


def normalise(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    words = _ARTICLES.sub(" ", first.lower().translate(_PUNCTUATION))
    return " ".join(words.split())


def is_correct(response: str, question: Question) -> bool:
    return normalise(response) in {normalise(answer) for answer in question.answers}


def accuracy(llm: LLM, questions: list[Question]) -> float:
    conversations = [[{"role": "user", "content": f"{q.question}\n{INSTRUCTION}"}]
                     for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    right = sum(is_correct(o.outputs[0].text, q) for o, q in zip(outputs, questions))
    return right / len(questions)
