"""A tokenizer's identity, to check that two models read token ids the same way.

:func:`vocab_digest` hashes the id -> token table, for a local or a served teacher
(``GET /v1/tokenizer``).
"""

from __future__ import annotations

import hashlib
import json


def vocab_digest(tokenizer) -> dict:
    """``{"vocab_size", "vocab_sha256"}`` of ``tokenizer``: the size and the SHA-256 of its
    sorted ``(token, id)`` table with the eos / pad / bos ids."""
    table = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    specials = [getattr(tokenizer, f"{k}_token_id", None) for k in ("eos", "pad", "bos")]
    text = json.dumps({"vocab": table, "specials": specials}, ensure_ascii=True)
    return {"vocab_size": len(table), "vocab_sha256": hashlib.sha256(text.encode()).hexdigest()}


def vocab_mismatch(student: dict, teacher: dict) -> str | None:
    """One line naming how two :func:`vocab_digest` s differ, or None when they are equal."""
    if student == teacher:
        return None
    if student.get("vocab_size") != teacher.get("vocab_size"):
        return (
            f"the teacher's tokenizer has {teacher.get('vocab_size')} tokens, "
            f"the student's {student.get('vocab_size')}"
        )
    return "the teacher's and the student's tokenizers map ids to different tokens"
