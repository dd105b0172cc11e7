"""`/tokenize` and `/detokenize` (vLLM's endpoints): only the daemon has the tokenizer, so they
come as Submits and are answered at once, without the model or a session: one Delta (the ids,
or the text) and a Finish whose usage counts the tokens, or the refusal naming the field.
"""

from __future__ import annotations

from daemon.model.tokenizer import Tokenizer
from daemon.prompts import chat_text, check_ids
from daemon.rejected import Rejected
from ipc.records import Delta, Finish, FinishReason, RequestKind, Submit, Usage
from ipc.wire import ToProxy


def tokenize(submit: Submit, tokenizer: Tokenizer) -> list[ToProxy]:
    try:
        if submit.kind is RequestKind.DETOKENIZE:
            ids = submit.prompt_ids[0] if submit.prompt_ids else []
            check_ids(ids, tokenizer.vocab_size, "tokens")
            return _answer(submit.rid, tokenizer.decode(ids), [], len(ids))
        ids = _encode(submit, tokenizer)
    except Rejected as e:
        return [e.to_error(submit.rid)]
    return _answer(submit.rid, "", ids, len(ids))


def _encode(submit: Submit, tokenizer: Tokenizer) -> list[int]:
    """vLLM's defaults: a prompt gets the tokenizer's special tokens, a chat template's text
    none (the template writes its own)."""
    if submit.messages:
        text = chat_text(tokenizer, submit.messages, submit.tools, submit.add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=bool(submit.add_special_tokens))
    special = True if submit.add_special_tokens is None else submit.add_special_tokens
    return tokenizer.encode(submit.prompts[0] if submit.prompts else "", add_special_tokens=special)


def _answer(rid: str, text: str, ids: list[int], count: int) -> list[ToProxy]:
    return [Delta(rid, 0, text, ids), Finish(rid, 0, FinishReason.STOP, Usage(count, 0))]
