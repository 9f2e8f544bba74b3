"""Exact-match accuracy on the question set shipped beside this module (questions.json).

60 short questions, 20 each of facts, arithmetic and extraction from a given sentence, each with
its accepted answers. Each is asked in the model's chat template with an instruction to answer
with the answer only, and answered greedily. Small models answer in a sentence anyway ("The
capital of France is Paris.", "2 + 3 = 5"), so the answer is read from the response's first
non-empty line as the text after its last "is", "are", "was", "=" or ":" (the whole line when
there is none). It is right when, normalised, it equals a normalised accepted answer.
Normalising lower-cases, deletes ASCII punctuation ("$12." -> "12", "o'clock" -> "oclock"),
drops the words a, an and the, and collapses whitespace.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from pathlib import Path

from tokenmill import LLM, SamplingParams

QUESTIONS_FILE = Path(__file__).with_name("questions.json")
INSTRUCTION = "Answer with only the answer."
MAX_ANSWER_TOKENS = 24
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER_MARKERS = re.compile(r"\bis\b|\bare\b|\bwas\b|=|:", re.IGNORECASE)


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


def extract_answer(response: str) -> str:
    lines = [line for line in response.strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    pieces = [piece for piece in _ANSWER_MARKERS.split(first) if piece.strip()]
    return pieces[-1] if pieces else first


def normalise(text: str) -> str:
    words = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(words.split())


def is_correct(response: str, question: Question) -> bool:
    answer = normalise(extract_answer(response))
    return answer in {normalise(accepted) for accepted in question.answers}


def accuracy(llm: LLM, questions: list[Question]) -> float:
    conversations = [[{"role": "user", "content": f"{q.question}\n{INSTRUCTION}"}]
                     for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    right = sum(is_correct(o.outputs[0].text, q) for o, q in zip(outputs, questions))
    return right / len(questions)
