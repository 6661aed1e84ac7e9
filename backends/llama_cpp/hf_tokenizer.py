"""A GGUF's SentencePiece vocabulary as Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``, and Gemma's
chat template, for the GGUF -> HF converter (``backends.llama_cpp.convert``).

The GGUF (``tokenizer.ggml.model == "llama"``) carries SentencePiece pieces with scores and token types; llama.cpp
tokenizes them by merging the adjacent pair whose joined piece scores highest, after splitting out user-defined
and (with special parsing) control tokens whole, with byte fallback for characters outside the vocabulary. The
same behaviour in the ``tokenizers`` library is a BPE model whose merges are ranked by the score of the piece they
make (ties by id), user-defined and control tokens as added tokens, spaces written as ``▁`` and no dummy prefix
(the GGUF says ``add_space_prefix`` false): the shape of Hugging Face's own Gemma tokenizer. The JSON is written
directly (the format is data), so meshgate's own install needs neither ``tokenizers`` nor ``transformers``; the
tests load it with both in the MLX venv and compare token ids with llama.cpp's.

The chat template renders exactly what ``backends.llama_cpp.prompt.render_gemma`` renders, with ``bos_token`` in
front (llama.cpp's runner adds BOS when tokenizing; an HF chat template carries it as text): system text folded
into the first user turn, tool results as user text, consecutive turns of one role joined by a blank line.

Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["GEMMA_CHAT_TEMPLATE", "tokenizer_config", "tokenizer_json"]

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Jinja, mirroring render_gemma/flatten: see the module docstring. Newlines only inside string literals.
GEMMA_CHAT_TEMPLATE = (
    "{%- macro text_of(m, sep) -%}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content -%}{{ m.content | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | select | join(sep) }}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro body_of(m) -%}"
    "{%- set parts = namespace(out=text_of(m, '\\n')) -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- set parts.out = 'Result of ' ~ (m.name or 'the tool') ~ ': ' ~ text_of(m, '') -%}"
    "{%- endif -%}"
    "{%- for call in (m.tool_calls or []) -%}"
    "{%- set f = call.function or call -%}"
    "{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}"
    "{%- set one = '{\"name\": ' ~ (f.name | tojson) ~ ', \"arguments\": ' ~ args ~ '}' -%}"
    "{%- set parts.out = (parts.out ~ '\\n' ~ one) if parts.out else one -%}"
    "{%- endfor -%}"
    "{{ parts.out }}"
    "{%- endmacro -%}"
    "{%- macro turn(role, text) -%}"
    "{{ '<start_of_turn>' ~ ('model' if role == 'assistant' else 'user') ~ '\\n' ~ text ~ '<end_of_turn>\\n' }}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set ns = namespace(system='', any_system=false, role='', text='', first=true) -%}"
    "{%- for m in messages if m.role == 'system' -%}"
    "{%- set ns.system = (ns.system ~ '\\n\\n' if ns.any_system else '') ~ text_of(m, '') -%}"
    "{%- set ns.any_system = true -%}"
    "{%- endfor -%}"
    "{%- macro flush() -%}"
    "{%- if ns.first and ns.system and ns.role == 'user' -%}{{ turn('user', ns.system ~ '\\n\\n' ~ ns.text) }}"
    "{%- elif ns.first and ns.system -%}{{ turn('user', ns.system) }}{{ turn(ns.role, ns.text) }}"
    "{%- else -%}{{ turn(ns.role, ns.text) }}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for m in messages if m.role != 'system' -%}"
    "{%- set role = 'assistant' if m.role == 'assistant' else 'user' -%}"
    "{%- set text = body_of(m) -%}"
    "{%- if ns.role == role -%}{%- set ns.text = ns.text ~ '\\n\\n' ~ text -%}"
    "{%- else -%}"
    "{%- if ns.role -%}{{ flush() }}{%- set ns.first = false -%}{%- endif -%}"
    "{%- set ns.role = role -%}{%- set ns.text = text -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.role -%}{{ flush() }}{%- elif ns.system -%}{{ turn('user', ns.system) }}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[list[str]]:
    """BPE merges that replay SentencePiece's score order: every split of a normal piece into two normal pieces,
    ranked by the joined piece's score (higher first), then its id."""
    normal = {tok: i for i, tok in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for tok, i in normal.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [[left, right] for _, _, left, right in ranked]


def tokenizer_json(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    bos_id: int | None,
    unk_id: int | None,
    add_bos: bool,
) -> dict[str, Any]:
    """The ``tokenizer.json`` document for a SentencePiece GGUF vocabulary without a dummy prefix."""
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": types[i] != USER_DEFINED,
        }
        for i, tok in enumerate(tokens)
        if types[i] in (CONTROL, USER_DEFINED, UNKNOWN, UNUSED)
    ]
    post = None
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        },
        "post_processor": post,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[unk_id] if unk_id is not None else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": _merges(tokens, scores, types),
        },
    }


def tokenizer_config(
    tokens: Sequence[str], meta: dict[str, Any], *, context: int, chat_template: str | None
) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens by text, BOS/EOS behaviour, the chat template."""

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "model_max_length": context,
        "padding_side": "left",
    }
    if chat_template:
        config["chat_template"] = chat_template
    return {k: v for k, v in config.items() if v is not None}
