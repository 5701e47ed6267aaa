"""The question sets of the PEER financial-QA example.

``load_questions(path)`` reads three formats (one question per line, detected per line):

* this example's own JSONL (``data/questions.jsonl``)::

      {"id": "macro-01", "category": "macro", "question": "...", "background": ["...", "..."]}

  ``background`` (0-5 snippets) is optional: the executors retrieve from the corpus anyway;
* agentUniverse's PEER question set: JSONL lines ``{"text": "..."}`` (id ``<file stem>-<line>``,
  category ``general``);
* plain text: one question per line (``#`` starts a comment).

The shipped snippets are also the default search corpus (``corpus.py``). All entities
(Arcadia, Borealis, Lumora Foods, ...) and figures are invented for illustration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

DATA_FILE = Path(__file__).resolve().parent / "data" / "questions.jsonl"

CATEGORIES: tuple[str, ...] = ("macro", "markets", "company_analysis", "policy", "reports")
GENERAL = "general"  # questions from agentUniverse's {"text": ...} files and plain text files
_ALIASES = {"company": "company_analysis", "company-analysis": "company_analysis",
            "company analysis": "company_analysis", "market": "markets", "report": "reports"}

MIN_SNIPPETS, MAX_SNIPPETS = 0, 5


class DataError(ValueError):
    """A malformed line in the questions file (the message names the file and line)."""


@dataclass(frozen=True)
class Question:
    id: str
    category: str
    question: str
    background: tuple[str, ...]


def normalize_category(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in CATEGORIES and key != GENERAL:
        raise ValueError(f"unknown category {name!r}; expected one of {', '.join(CATEGORIES)}")
    return key


def _parse_line(raw: str, where: str, default_id: str = "q") -> Question:
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if "text" in doc and "question" not in doc:  # agentUniverse's PEER question set
        text = doc["text"]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: field 'text' must be a non-empty string")
        return Question(str(doc.get("id") or default_id), GENERAL, text.strip(), ())
    doc.setdefault("background", [])
    missing = [k for k in ("id", "category", "question") if k not in doc]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(missing)}")
    for k in ("id", "category", "question"):
        if not isinstance(doc[k], str) or not doc[k].strip():
            raise DataError(f"{where}: field {k!r} must be a non-empty string")
    if doc["category"] not in CATEGORIES:
        raise DataError(f"{where}: category {doc['category']!r} is not one of {', '.join(CATEGORIES)}")
    bg = doc["background"]
    if not isinstance(bg, list) or not all(isinstance(s, str) and s.strip() for s in bg):
        raise DataError(f"{where}: 'background' must be a list of non-empty strings")
    if not MIN_SNIPPETS <= len(bg) <= MAX_SNIPPETS:
        raise DataError(f"{where}: 'background' needs {MIN_SNIPPETS}-{MAX_SNIPPETS} snippets, got {len(bg)}")
    extra = set(doc) - {"id", "category", "question", "background"}
    if extra:
        raise DataError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
    return Question(doc["id"].strip(), doc["category"], doc["question"].strip(),
                    tuple(s.strip() for s in bg))


def load_questions(path: Path | str = DATA_FILE) -> list[Question]:
    """Load and validate every question; raises :class:`DataError` on the first bad line."""
    path = Path(path)
    out: list[Question] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("//") or line.startswith("#"):
                continue
            where = f"{path.name}:{lineno}"
            qid = f"{path.stem}-{lineno:03d}"
            if line.startswith("{"):
                q = _parse_line(raw, where, qid)
            else:  # a plain-text question
                q = Question(qid, GENERAL, line, ())
            if q.id in seen:
                raise DataError(f"{where}: duplicate id {q.id!r} (first on line {seen[q.id]})")
            seen[q.id] = lineno
            out.append(q)
    if not out:
        raise DataError(f"{path}: no questions")
    return out


def select(questions: Sequence[Question], *, n: Optional[int] = None,
           ids: Optional[Iterable[str]] = None, category: Optional[str] = None) -> list[Question]:
    """Pick questions: by ``ids`` (in the given order), else by ``category``, else round-robin
    across categories so a small ``n`` still covers several of them."""
    if ids:
        by_id = {q.id: q for q in questions}
        wanted = [i.strip() for i in ids if i.strip()]
        unknown = [i for i in wanted if i not in by_id]
        if unknown:
            raise ValueError(f"unknown question id(s): {', '.join(unknown)}")
        picked = [by_id[i] for i in wanted]
    elif category:
        cat = normalize_category(category)
        picked = [q for q in questions if q.category == cat]
    else:
        buckets = [[q for q in questions if q.category == c] for c in (*CATEGORIES, GENERAL)]
        picked = []
        for i in range(max((len(b) for b in buckets), default=0)):
            picked += [b[i] for b in buckets if i < len(b)]
    return picked[:n] if n is not None else picked
