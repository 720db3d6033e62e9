"""A built-in paraphrase / non-paraphrase set for choosing the semantic threshold.

Agent-style requests, written for Weft. Paraphrases ask for the same thing in other
words (a cached answer to one is a right answer to the other); non-paraphrases are
mostly *hard* negatives: the same topic or wording with a different intent or a
different parameter (a cached answer would be wrong). ``choose_threshold`` picks the
lowest threshold with no false positive on the set, plus a margin.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PARAPHRASES: tuple[tuple[str, str], ...] = (
    ("How do I reset my password?", "What are the steps to reset my password?"),
    ("Cancel my subscription, please.", "Please cancel my subscription."),
    ("What is the refund policy for damaged items?", "What's your refund policy if an item arrives damaged?"),
    ("Summarize this quarter's sales report.", "Give me a summary of the sales report for this quarter."),
    ("Where is my order?", "Can you tell me where my order is?"),
    ("List all open pull requests in the repository.", "Show me every open pull request in the repo."),
    ("Translate 'good morning' into French.", "How do you say 'good morning' in French?"),
    ("What time does the store close today?", "When does the store close today?"),
    ("Find flights from Paris to Berlin next Monday.", "Search for flights next Monday from Paris to Berlin."),
    ("Write a Python function that reverses a string.", "Write a function in Python to reverse a string."),
    ("How can I update my shipping address?", "How do I change my shipping address?"),
    ("Check the weather forecast for London tomorrow.", "What's tomorrow's weather forecast in London?"),
    ("Explain what a hash table is.", "What is a hash table? Please explain."),
    ("Book a table for two at 7pm tonight.", "Reserve a table for two people tonight at 7pm."),
    ("What is my current account balance?", "How much money is in my account right now?"),
    ("Delete the file named report.txt.", "Remove the file called report.txt."),
    ("Convert 100 US dollars to euros.", "How much is 100 USD in euros?"),
    ("Send an email to the team about the delayed release.", "Email the team to let them know the release is delayed."),
    ("What are your customer support hours?", "When is customer support available?"),
    ("Restart the web server.", "Please restart the web server."),
    ("How do I enable two-factor authentication?", "How can I turn on two-factor authentication?"),
    ("Show me the error logs from the last hour.", "Display the last hour of error logs."),
)

NON_PARAPHRASES: tuple[tuple[str, str], ...] = (
    ("How do I reset my password?", "How do I reset my router?"),
    ("Cancel my subscription, please.", "Upgrade my subscription, please."),
    ("What is the refund policy for damaged items?", "What is the shipping policy for international orders?"),
    ("Summarize this quarter's sales report.", "Summarize last year's marketing budget."),
    ("Where is my order?", "Where is your nearest store?"),
    ("List all open pull requests in the repository.", "List all closed issues in the repository."),
    ("Translate 'good morning' into French.", "Translate 'good morning' into Japanese."),
    ("What time does the store close today?", "What time does the store open tomorrow?"),
    ("Find flights from Paris to Berlin next Monday.", "Find hotels in Berlin for next Monday."),
    ("Write a Python function that reverses a string.", "Write a Python function that sorts a list."),
    ("How can I update my shipping address?", "How can I update my payment method?"),
    ("Check the weather forecast for London tomorrow.", "Check the traffic in London right now."),
    ("Explain what a hash table is.", "Explain what a linked list is."),
    ("Book a table for two at 7pm tonight.", "Cancel my table reservation for tonight."),
    ("What is my current account balance?", "Transfer 50 dollars to my savings account."),
    ("Delete the file named report.txt.", "Open the file named report.txt."),
    ("Convert 100 US dollars to euros.", "Convert 100 euros to Japanese yen."),
    ("Send an email to the team about the delayed release.", "Schedule a meeting with the team about the release."),
    ("What are your customer support hours?", "What is your customer support phone number?"),
    ("Restart the web server.", "Shut down the database server."),
    ("How do I enable two-factor authentication?", "How do I disable two-factor authentication?"),
    ("Show me the error logs from the last hour.", "Show me the CPU usage for the last hour."),
    ("What is the capital of France?", "How do I bake sourdough bread?"),
    ("Recommend a good science fiction novel.", "Fix the failing unit test in the parser module."),
)


@dataclass(frozen=True)
class ThresholdReport:
    threshold: float
    precision: float  # of pairs at or above the threshold, the share that are paraphrases
    recall: float  # of paraphrases, the share at or above the threshold
    num_pairs: int
    max_negative: float  # highest similarity among non-paraphrases
    min_positive: float  # lowest similarity among paraphrases


def score(pos: Sequence[float], neg: Sequence[float], threshold: float) -> tuple[float, float]:
    """(precision, recall) at ``threshold``; precision of an empty selection is 1."""
    tp = sum(1 for s in pos if s >= threshold)
    fp = sum(1 for s in neg if s >= threshold)
    return (tp / (tp + fp) if tp + fp else 1.0), (tp / len(pos) if pos else 0.0)


def choose_threshold(pos: Sequence[float], neg: Sequence[float], margin: float = 0.02) -> ThresholdReport:
    """Lowest threshold above every non-paraphrase's similarity, plus ``margin``
    (rounded up to 0.01): a response cache must prefer a miss to a wrong answer."""
    t = max(neg) + margin
    t = round(-(-t * 100 // 1) / 100, 2)
    precision, recall = score(pos, neg, t)
    return ThresholdReport(t, precision, recall, len(pos) + len(neg), max(neg), min(pos))


def similarities(embedder) -> tuple[list[float], list[float]]:
    """Cosine similarity of every paraphrase and non-paraphrase pair with ``embedder``."""
    def sims(pairs):
        a = embedder.embed([x for x, _ in pairs])
        b = embedder.embed([y for _, y in pairs])
        return [float(v) for v in (a * b).sum(-1)]
    return sims(PARAPHRASES), sims(NON_PARAPHRASES)
