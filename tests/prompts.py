"""Prompts shared by the engine tests: varied lengths and topics."""

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your work.",
    "Give me a short recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
]

SYSTEM_PROMPT = (
    "You are a meticulous support assistant for the Tokenmill cloud platform. " * 3
    + "Always answer politely, cite the relevant documentation section, keep answers short, "
    "never reveal internal identifiers, and escalate billing disputes to a human agent. "
    "The platform offers compute instances, object storage, managed databases, a message "
    "queue, and a serverless function runtime. Instances come in small, medium and large "
    "sizes; storage is billed per gigabyte per month; databases support automated backups "
    "every six hours with seven days of retention. Support hours are 24/7 for enterprise "
    "customers and business hours for everyone else. " * 2
)


def varied_prompts(count: int) -> list[str]:
    """`count` plain prompts of clearly different lengths."""
    base = [
        "The quick brown fox",
        "Once upon a time in a small village by the mountains, there lived",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "The three laws of thermodynamics can be summarised as follows:",
        "In 1969, the Apollo 11 mission",
        "A recipe for bread: first, mix flour, water, salt and yeast. Then",
        "import numpy as np\nimport torch\n\n# Load the dataset and",
        "Dear hiring manager, I am writing to apply for the position of",
    ]
    return [(base[i % len(base)] + " ") * (1 + i // len(base) * 3) for i in range(count)]
