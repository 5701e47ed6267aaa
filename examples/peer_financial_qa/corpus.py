"""The executors' search tool: BM25 over a local corpus (``bm25s``).

* Default corpus: every background snippet shipped in ``data/questions.jsonl`` (one passage
  each, id ``<question id>/S<n>``), so any question, the user's included, is answered from the
  same library of notes.
* ``Corpus.from_dir(DIR)``: the user's own text files (``*.txt``, ``*.md``; recursively), split
  into passages at blank lines (long paragraphs are cut at about ``max_chars``), ids
  ``<relative path>#<n>``.

``corpus.search(query, k)`` returns the ``k`` best passages (BM25, English stop words removed;
passages that share no word with the query are not returned). :func:`search_tool` wraps it as the
LangChain tool ``search_corpus(query)`` a LangGraph ``ToolNode`` runs; its result lists the
passages as ``[id] text`` lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
MAX_QUERY_CHARS = 80  # the tool's schema says so: the grammar keeps a small model's query short


@dataclass(frozen=True)
class Passage:
    id: str
    text: str


class CorpusError(ValueError):
    pass


class Corpus:
    def __init__(self, passages: Sequence[Passage]) -> None:
        import bm25s

        passages = [p for p in passages if p.text.strip()]
        if not passages:
            raise CorpusError("the corpus has no text")
        self.passages = list(passages)
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([p.text for p in self.passages], stopwords="en", show_progress=False),
                         show_progress=False)

    def __len__(self) -> int:
        return len(self.passages)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_questions(cls, questions: Iterable[Any]) -> "Corpus":
        """Every question's background snippets, one passage each (``<qid>/S<n>``)."""
        seen: set[str] = set()
        out = []
        for q in questions:
            for i, text in enumerate(getattr(q, "background", ()) or (), 1):
                if text not in seen:
                    seen.add(text)
                    out.append(Passage(f"{q.id}/S{i}", text))
        return cls(out)

    @classmethod
    def from_dir(cls, root: str | Path, max_chars: int = 800) -> "Corpus":
        root = Path(root)
        if not root.is_dir():
            raise CorpusError(f"--corpus {root}: not a directory")
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise CorpusError(f"--corpus {root}: no text files ({', '.join(TEXT_SUFFIXES)})")
        out = []
        for f in files:
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                raise CorpusError(f"--corpus {f}: {e}") from None
            rel = f.relative_to(root).as_posix()
            for n, chunk in enumerate(split_passages(text, max_chars), 1):
                out.append(Passage(f"{rel}#{n}", chunk))
        return cls(out)

    # -- search ----------------------------------------------------------------------------------
    def search(self, query: str, k: int = 3) -> list[tuple[Passage, float]]:
        bm = self._bm25s
        toks = bm.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not toks or not toks[0]:
            return []
        k = min(k, len(self.passages))
        docs, scores = self.index.retrieve(toks, k=k, show_progress=False)
        return [(self.passages[int(d)], float(s)) for d, s in zip(docs[0], scores[0]) if s > 0]


def split_passages(text: str, max_chars: int = 800) -> list[str]:
    """Paragraphs (blank-line separated), whitespace collapsed; a paragraph longer than
    ``max_chars`` is cut at sentence ends."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = re.sub(r"\s+", " ", para).strip()
        while len(para) > max_chars:
            cut = para.rfind(". ", 0, max_chars)
            cut = cut + 1 if cut > max_chars // 3 else max_chars
            out.append(para[:cut].strip())
            para = para[cut:].strip()
        if para:
            out.append(para)
    return out


def format_results(results: Sequence[tuple[Passage, float]]) -> str:
    if not results:
        return "(no passage matched the query)"
    return "\n".join(f"[{p.id}] {p.text}" for p, _ in results)


def search_tool(corpus: Corpus, k: int = 3, delay_s: float = 0.0) -> Any:
    """``search_corpus(query)`` as a LangChain tool. ``delay_s`` adds a search backend's
    latency (the tool gap the cache policy plans around); 0 runs at local BM25 speed."""
    import time

    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class SearchArgs(BaseModel):
        query: str = Field(description="a few keywords: entity, indicator, period", min_length=3,
                           max_length=MAX_QUERY_CHARS)

    @tool(args_schema=SearchArgs)
    def search_corpus(query: str) -> str:
        """Search the research notes for passages relevant to the query (keywords work best)."""
        if delay_s:
            time.sleep(delay_s)
        return format_results(corpus.search(query, k))

    return search_corpus


_DEFAULT: Optional[Corpus] = None


def default_corpus(questions: Optional[Iterable[Any]] = None) -> Corpus:
    """The shipped snippets (all questions of ``data/questions.jsonl``; indexed once)."""
    global _DEFAULT
    from .data import load_questions

    if questions is not None:
        return Corpus.from_questions(questions)
    if _DEFAULT is None:
        _DEFAULT = Corpus.from_questions(load_questions())
    return _DEFAULT
