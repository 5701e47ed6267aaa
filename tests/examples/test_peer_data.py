"""The PEER financial-QA example's data (examples/peer_financial_qa): the shipped questions, the
question file formats and their errors, selection, and the corpus the executors search. The
graph, prompts, usage accounting, server helper and CLI are test_peer_example.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.peer_financial_qa import data  # noqa: E402

QUESTIONS = data.load_questions()


def test_data_file_has_40_valid_questions_across_5_categories():  # (also the default corpus)
    assert len(QUESTIONS) >= 40
    counts = {c: sum(q.category == c for q in QUESTIONS) for c in data.CATEGORIES}
    assert set(counts) == {"macro", "markets", "company_analysis", "policy", "reports"}
    assert all(n >= 6 for n in counts.values()), counts
    assert len({q.id for q in QUESTIONS}) == len(QUESTIONS)
    for q in QUESTIONS:
        assert 3 <= len(q.background) <= 5 and q.question.endswith("?")
        assert all(40 <= len(s) <= 600 for s in q.background), q.id


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"id": "x", "category": "macro"}', "missing field(s) question"),
    ('{"id": "x", "category": "crypto", "question": "q?", "background": ["a", "b", "c"]}', "category 'crypto'"),
    ('{"id": "x", "category": "macro", "question": "q?", "background": ["a", "b", "c", "d", "e", "f"]}',
     "0-5 snippets"),
    ('{"text": ""}', "'text'"),
    ('{"id": "x", "category": "macro", "question": "", "background": ["a", "b", "c"]}', "'question'"),
])
def test_loader_reports_bad_line(tmp_path, line, message):
    good = json.dumps({"id": "ok-1", "category": "macro", "question": "Q?", "background": ["a", "b", "c"]})
    f = tmp_path / "q.jsonl"
    f.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(data.DataError) as e:
        data.load_questions(f)
    assert "q.jsonl:3" in str(e.value) and message in str(e.value)


def test_loader_rejects_duplicate_ids(tmp_path):
    good = json.dumps({"id": "ok-1", "category": "macro", "question": "Q?", "background": ["a", "b", "c"]})
    f = tmp_path / "q.jsonl"
    f.write_text(good + "\n" + good + "\n")
    with pytest.raises(data.DataError, match="duplicate id 'ok-1'"):
        data.load_questions(f)


def test_select_round_robin_ids_and_category():
    first5 = data.select(QUESTIONS, n=5)
    assert [q.category for q in first5] == list(data.CATEGORIES)
    assert [q.id for q in data.select(QUESTIONS, ids=["co-02", "macro-01"])] == ["co-02", "macro-01"]
    assert {q.category for q in data.select(QUESTIONS, category="company")} == {"company_analysis"}
    with pytest.raises(ValueError, match="unknown question id"):
        data.select(QUESTIONS, ids=["nope"])


def test_agentuniverse_text_jsonl_and_plain_text_questions(tmp_path):
    """agentUniverse's PEER question set is JSONL lines {"text": ...}; a plain file is one
    question per line. Both load without background (the executors retrieve it)."""
    au = tmp_path / "peer_questions.jsonl"
    au.write_text('{"text": "Why did Arcadia\'s inflation fall in Q3?"}\n\n{"text": "Is Lumora Foods profitable?"}\n')
    qs = data.load_questions(au)
    assert [(q.id, q.category, q.background) for q in qs] == [("peer_questions-001", "general", ()),
                                                              ("peer_questions-003", "general", ())]
    assert qs[0].question == "Why did Arcadia's inflation fall in Q3?"
    plain = tmp_path / "mine.txt"
    plain.write_text("# my questions\nWhat drives Borealis bond yields?\nHow are Arcadian banks doing?\n")
    assert [q.question for q in data.load_questions(plain)] == ["What drives Borealis bond yields?",
                                                               "How are Arcadian banks doing?"]
    assert [q.id for q in data.select(data.load_questions(plain), n=5)] == ["mine-002", "mine-003"]


def test_corpus_search_over_shipped_snippets_and_a_directory(tmp_path):
    from examples.peer_financial_qa.corpus import Corpus, CorpusError, default_corpus, search_tool

    c = default_corpus()
    assert len(c) == sum(len(q.background) for q in QUESTIONS)
    hits = c.search("Arcadian crown weakened against the Borealis mark", k=3)
    assert hits and hits[0][0].id == "macro-01/S4" and hits[0][1] > 0
    assert c.search("the of and", k=3) == []  # stop words only: nothing to rank
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("Zeta Corp raised prices by 4%.\n\nZeta's margin rose to 31%.")
    (tmp_path / "notes" / "b.txt").write_text("Omega Bank cut its dividend.")
    mine = Corpus.from_dir(tmp_path / "notes")
    assert [p.id for p in mine.passages] == ["a.md#1", "a.md#2", "b.txt#1"]
    out = search_tool(mine).invoke({"query": "Zeta margin"})
    assert out.splitlines()[0] == "[a.md#2] Zeta's margin rose to 31%."
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.bin").write_bytes(b"\0")
    with pytest.raises(CorpusError, match="no text files"):
        Corpus.from_dir(tmp_path / "empty")
    with pytest.raises(CorpusError, match="not a directory"):
        Corpus.from_dir(tmp_path / "nope")
