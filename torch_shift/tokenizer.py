"""Tokenizer loaded from a Hugging Face model directory: encode/decode, chat templates, incremental detokenization."""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers.decoders import DecodeStream

_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_bytes() -> dict[str, int]:
    """The byte each character of a byte-level BPE's alphabet stands for (GPT-2's bytes_to_unicode, inverted):
    printable Latin-1 bytes are themselves, the others 256 and up in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


# Tokenizer.stop_string_token_ids: the lists of stop strings whose tokens a tokenizer keeps (the oldest dropped
# first), and the most stop strings and tokens it finds (past them: any token, and a run or check of one request
# runs one step at a time)
STOP_STRING_SETS = 64
MAX_STOP_STRINGS = 64
STOP_STRING_TOKENS = 4096

# Prompt tokens handed to DecodeStream as context, so that the first generated token decodes as it would after
# the prompt (e.g. SentencePiece's leading space is kept instead of stripped as at the start of a text).
_DETOKENIZER_CONTEXT_TOKENS = 8


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its Hugging Face model directory."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool | None = None,
        chat_template: str | Mapping[str, str] | None = None,
    ) -> None:
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.bos_token_id = self._token_id(bos_token)
        self.pad_token_id = self._token_id(pad_token)
        eos_token_id = self._token_id(eos_token)
        self.eos_token_ids: frozenset[int] = frozenset(
            [*([eos_token_id] if eos_token_id is not None else []), *extra_eos_token_ids]
        )
        # by name, as transformers holds several: "default", and "tool_use" for requests with tools
        self.chat_templates: dict[str, str] = (dict(chat_template) if isinstance(chat_template, Mapping)
                                               else {} if chat_template is None else {"default": chat_template})

        self._post_processor_adds_bos = self.bos_token_id is not None and self._encode_adds_bos()
        # A bos that tokenizer.json's post-processor adds is kept even if tokenizer_config.json says
        # add_bos_token=false (transformers 5 ignores add_bos_token when tokenizer.json exists).
        self._prepend_bos = bool(add_bos_token) and self.bos_token_id is not None and not self._post_processor_adds_bos
        self.add_bos_token: bool = self._post_processor_adds_bos or self._prepend_bos

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json and, where present, tokenizer_config.json, special_tokens_map.json,
        generation_config.json, config.json and chat_template.jinja / chat_template.json."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"No tokenizer.json in {model_dir}: torch_shift needs a Hugging Face 'fast' tokenizer file there"
            )
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens_map = _read_json(model_dir / "special_tokens_map.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        text_model_config = model_config.get("text_config") or {}

        def special_token(name: str) -> str | None:
            return _token_content(tokenizer_config.get(name)) or _token_content(special_tokens_map.get(name))

        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        if tokenizer_config.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast"):
            _as_transformers_llama(backend, tokenizer_config)
        bos_token = special_token("bos_token")
        eos_token = special_token("eos_token")
        pad_token = special_token("pad_token")
        eos_token_ids = model_eos_token_ids(model_dir)
        # Fall back to config ids for tokens that tokenizer_config.json does not name.
        if bos_token is None:
            bos_token = _first_token(backend, generation_config, model_config, text_model_config, key="bos_token_id")
        if eos_token is None and eos_token_ids:
            eos_token = backend.id_to_token(eos_token_ids[0])
        if pad_token is None:
            pad_token = _first_token(backend, generation_config, model_config, text_model_config, key="pad_token_id")

        add_bos_token = tokenizer_config.get("add_bos_token")
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            unk_token=special_token("unk_token"),
            extra_eos_token_ids=eos_token_ids,
            add_bos_token=bool(add_bos_token) if add_bos_token is not None else None,
            chat_template=_read_chat_template(model_dir, tokenizer_config),
        )

    def __len__(self) -> int:
        return self.vocab_size

    # transformers' names that scripts written for vLLM's get_tokenizer() reach for
    @property
    def eos_token_id(self) -> int | None:
        """The eos token's id (None without one); `eos_token_ids` holds every id that ends a request."""
        return self._token_id(self.eos_token)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._added_token_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.backend.id_to_token(token_id) for token_id in self.all_special_ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def batch_decode(self, sequences: Iterable[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """transformers' call, without tensors: {"input_ids": ids} (a list of them for a list of texts)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; with add_special_tokens, the post-processor's special tokens and exactly one bos."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        token_ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_token_id is not None:
            bos = self.bos_token_id
            if self._prepend_bos and token_ids[:1] != [bos]:
                token_ids.insert(0, bos)
            elif token_ids[:2] == [bos, bos]:  # text that already starts with the bos token, e.g. a rendered chat
                del token_ids[0]
        return token_ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        """Text of one token, special tokens included, for display (e.g. logprobs)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str]:
        """The vocabulary's pieces (`"Ġthe"` for " the" in a byte-level BPE), as transformers' method of this name
        gives them and vLLM's /tokenize returns them."""
        return [self.backend.id_to_token(token_id) for token_id in token_ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (OpenAI's logprobs `bytes`, which a client joins to rebuild a text whose
        characters span tokens): a byte-level BPE token's own bytes, a byte-fallback token's byte (<0xE6>), a
        SentencePiece piece with its spaces; else (added tokens, other decoders) its text in UTF-8."""
        piece = self.backend.id_to_token(token_id)
        if piece is None or token_id in self._added_token_ids:
            return self.token_to_str(token_id).encode()
        decoders = self._decoder_types
        if "ByteLevel" in decoders:
            byte_of = _byte_level_bytes()
            if all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
        elif "ByteFallback" in decoders and (match := _BYTE_FALLBACK_PIECE.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        elif "Metaspace" in decoders or "Replace" in decoders:
            return piece.replace("▁", " ").encode()
        return self.token_to_str(token_id).encode()

    def stop_string_token_ids(self, stops: Sequence[str]) -> frozenset[int] | None:
        """The tokens that may complete one of `stops` in the text the detokenizer emits, where it held no text back
        before them (IncrementalDetokenizer.holds_text: held text comes out with the next token, whatever its bytes);
        None where any token may, or more than STOP_STRING_TOKENS would. A stop string is then found at the step of
        the token that brings its last byte: such a token starts with a suffix of the stop string (its start came
        earlier) or holds all of it. Each token's bytes are `token_bytes`'s, and where those are a token's text
        decoded alone, also its text decoded after another token (`_emitted_bytes`). A stop string holding U+FFFD,
        which the detokenizer writes for bytes that form no character, may end at any token; more than
        MAX_STOP_STRINGS of them are not looked at (any token). A multi-step run or a redrafting check of one request
        ends after a step that drew one (Request.lone_stop_token_ids). Kept for the last STOP_STRING_SETS lists of
        stop strings; a new list costs about 1-3 ms at 152k tokens (the vocabulary's bytes, once: 0.4 s)."""
        stops = tuple(stops)
        if stops in self._stop_string_tokens:
            return self._stop_string_tokens[stops]
        # the vocabulary's bytes in order and joined, made once (a call with no stop strings makes them ahead)
        starts, ids_by_start = self._sorted_emitted_bytes
        blob, offsets, ids_by_offset = self._joined_emitted_bytes
        ids: set[int] | None = set()
        if len(stops) > MAX_STOP_STRINGS or any("\ufffd" in stop for stop in stops):
            ids = None
        for encoded in (stop.encode() for stop in stops if ids is not None):
            for n in range(1, len(encoded) + 1):
                suffix = encoded[-n:]
                k = bisect.bisect_left(starts, suffix)
                while k < len(starts) and starts[k].startswith(suffix):
                    ids.add(ids_by_start[k])
                    k += 1
            place = blob.find(encoded)
            while place != -1 and len(ids) <= STOP_STRING_TOKENS:  # every place, overlapping ones too
                k = bisect.bisect_right(offsets, place) - 1
                if place + len(encoded) <= offsets[k + 1]:  # inside one token's bytes
                    ids.add(ids_by_offset[k])
                place = blob.find(encoded, place + 1)
            if len(ids) > STOP_STRING_TOKENS:
                ids = None
        found = None if ids is None else frozenset(ids)
        if len(self._stop_string_tokens) >= STOP_STRING_SETS:
            del self._stop_string_tokens[next(iter(self._stop_string_tokens))]
        self._stop_string_tokens[stops] = found
        return found

    @cached_property
    def _stop_string_tokens(self) -> dict[tuple[str, ...], frozenset[int] | None]:
        return {}

    @cached_property
    def _joined_emitted_bytes(self) -> tuple[bytes, list[int], list[int]]:
        """Every token's `_emitted_bytes` joined, where each starts (and the end), and the id of each: the tokens that
        hold some bytes are the places a search of the whole finds them inside one."""
        variants = [(b, i) for i, token in enumerate(self._emitted_bytes) for b in token]
        offsets = [0]
        for b, _ in variants:
            offsets.append(offsets[-1] + len(b))
        return b"".join(b for b, _ in variants), offsets, [i for _, i in variants]

    @cached_property
    def _sorted_emitted_bytes(self) -> tuple[list[bytes], list[int]]:
        """Every token's `_emitted_bytes` in byte order, and the id of each: the tokens that start with some bytes are
        a range of it."""
        pairs = sorted((b, i) for i, variants in enumerate(self._emitted_bytes) for b in variants)
        return [b for b, _ in pairs], [i for _, i in pairs]

    @cached_property
    def _emitted_bytes(self) -> list[tuple[bytes, ...]]:
        """Per token id, the bytes it may add to the detokenized text (stop_string_token_ids): token_bytes', and where
        those are its text decoded alone (another decoder than ByteLevel's, ByteFallback's or Metaspace's), also its
        text decoded after another token, as the detokenizer emits it (a WordPiece decoder joins words with a space
        there and drops a piece's "##"). About 0.35 s for a vocabulary of 152k tokens, once."""
        own = list(map(self.token_bytes, range(self.vocab_size)))
        if self._decoder_types & {"ByteLevel", "ByteFallback", "Metaspace", "Replace"}:
            return [(b,) for b in own]
        added = self._added_token_ids
        before = next(i for i in range(self.vocab_size) if i not in added)
        start = len(self.backend.decode([before], skip_special_tokens=False))
        after = self.backend.decode_batch([[before, i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return [(b, text[start:].encode()) for b, text in zip(own, after)]

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _decoder_types(self) -> frozenset[str]:
        """The types of the tokenizer's decoder and of those in its sequence (ByteLevel, ByteFallback, ...)."""
        decoder = self.backend.decoder
        described = json.loads(decoder.__getstate__()) if decoder is not None else {}
        return frozenset(d.get("type") for d in [described, *described.get("decoders", [])])

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None: none); set, it replaces every named one (a server's --chat-template)."""
        return self.chat_templates.get("default")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self.chat_templates = {} if template is None else {"default": template}

    def _template_for(self, tools: Any) -> str | None:
        """transformers' choice: the "tool_use" template for a request with tools, where the model has one."""
        return self.chat_templates.get("tool_use" if tools is not None and "tool_use" in self.chat_templates
                                       else "default")

    def reads_content_parts(self, tools: Any = None) -> bool:
        """Whether the template a request (with `tools` or without) renders with walks a message's content as a
        list of text parts (`template_reads_content_parts`)."""
        template = self._template_for(tools)
        return template is not None and template_reads_content_parts(template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render messages with the chat template as transformers does; token ids if tokenize (no extra bos).
        `continue_final_message`: the text ends inside the last message (an assistant turn the model continues),
        cut after its content, as transformers cuts it. `chat_template`: a Jinja template instead of the model's.
        Other keywords are template variables, as in transformers, but for transformers' options of its tensor
        outputs (`return_tensors`, `return_dict`, `padding`, ...), which are refused: this returns text or a list
        of ids. (Defaults differ from transformers': text with the generation prompt, as vLLM renders chats.)"""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second opens a new one")
        refused = sorted(name for name in _TENSOR_OUTPUT_OPTIONS if kwargs.get(name) not in (None, False))
        if refused:
            raise ValueError(f"apply_chat_template: {', '.join(refused)} (transformers' tensor outputs) are not "
                             "supported: it returns the text, or a list of token ids with tokenize=True")
        kwargs = {name: value for name, value in kwargs.items() if name not in _TENSOR_OUTPUT_OPTIONS}
        template = self._template_for(kwargs.get("tools")) if chat_template is None else chat_template
        if template is None:
            raise ValueError(
                "This tokenizer has no chat template (none in tokenizer_config.json, chat_template.jinja or "
                "chat_template.json); pass raw prompts instead of messages"
            )
        special_tokens = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        template_variables = {
            "tools": None,
            "documents": None,
            **{name: token for name, token in special_tokens.items() if token is not None},
            **kwargs,
        }
        messages = _validated_messages(messages)
        if continue_final_message:  # transformers' way: a tag after the content marks where the text is cut
            content = messages[-1]["content"]
            if isinstance(content, str):
                content += _CONTINUE_TAG
            else:  # after the last text part
                last = max((i for i, part in enumerate(content) if "text" in part), default=None)
                if last is None:
                    raise ValueError("continue_final_message: the last message has no text to continue")
                content = [{**part, "text": part["text"] + _CONTINUE_TAG} if i == last else part
                           for i, part in enumerate(content)]
            messages[-1] = {**messages[-1], "content": content}
        try:
            text = _compile_chat_template(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **template_variables
            )
        except jinja2.exceptions.TemplateError as e:  # the template's own raise_exception (an unknown role, ...)
            raise ValueError(f"the chat template refused the messages: {e}") from None
        if continue_final_message:
            text = _cut_at_continue_tag(text)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _encode_adds_bos(self) -> bool:
        with_special = self.backend.encode("a", add_special_tokens=True).ids
        without_special = self.backend.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [self.bos_token_id] and without_special[:1] != [self.bos_token_id]


# transformers' apply_chat_template options for tensor outputs, which this tokenizer does not make
_TENSOR_OUTPUT_OPTIONS = ("return_tensors", "return_dict", "return_assistant_tokens_mask", "padding", "truncation",
                          "max_length")


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time, never emitting part of a UTF-8 character.

    step() returns the text completed by the token ("" while a character is still incomplete). The chunks
    concatenate to the decoding of the generated ids that follow the prompt; flush() returns what is still held back
    at the end (replacement characters for bytes that never completed a character).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        context_ids = list(prompt_token_ids[-_DETOKENIZER_CONTEXT_TOKENS:])
        context_text = self._backend.decode(context_ids, skip_special_tokens=skip_special_tokens)
        # DecodeStream would re-emit a context that ends in an incomplete character.
        if context_text.endswith("\ufffd"):
            context_ids, context_text = [], ""
        self._context_ids = context_ids
        self._context_text = context_text
        self._stream = DecodeStream(context_ids, skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self._chunks: list[str] = []
        self._num_held_back_ids = 0
        self._flushed = False

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def holds_text(self) -> bool:
        """Whether text is held back for a character not finished yet (or a skipped special token's step gave none):
        the next token's text holds it, whatever that token's bytes."""
        return self._num_held_back_ids > 0

    def step(self, token_id: int) -> str:
        if self._flushed:
            raise RuntimeError("step() after flush(): flush() ends the detokenization")
        self.token_ids.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as error:
            # Decoders whose output is not monotonic in the ids (text already emitted changes) break DecodeStream;
            # restart it, as vLLM does, rather than fail the request.
            if not str(error).startswith("Invalid prefix"):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            text = self._stream.step(self._backend, token_id)
        if not text:
            self._num_held_back_ids += 1
            return ""
        self._num_held_back_ids = 0
        self._chunks.append(text)
        return text

    def flush(self) -> str:
        """Return the text held back for an incomplete character; call once, when generation ends."""
        self._flushed = True
        if self._num_held_back_ids == 0:
            return ""
        all_ids = self._context_ids + self.token_ids
        full_text = self._backend.decode(all_ids, skip_special_tokens=self._skip_special_tokens)
        remainder = full_text[len(self._context_text) + len(self.output_text) :]
        if remainder:
            self._chunks.append(remainder)
        return remainder


def _as_transformers_llama(backend: tokenizers.Tokenizer, tokenizer_config: Mapping[str, Any]) -> None:
    """transformers 5's LlamaTokenizer (Llama 2's, Mistral's, Mixtral's class) rebuilds a SentencePiece-style file's
    pipeline, and vLLM reads it through transformers: no normalizer, and a Metaspace pre-tokenizer that puts "▁"
    before the first piece of the text only (`legacy: false`, the default), before every piece between special
    tokens (`legacy: true`), or nowhere (`add_prefix_space: false`). The file's own normalizer put it before every
    piece and doubled a leading space: " x" was "▁▁x", "<s>[INST]" "<s>▁[INST]". A byte-level file is read as it
    is, as transformers reads it."""
    if "ByteLevel" in backend.to_str():
        return
    prefix = tokenizer_config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if tokenizer_config.get("legacy", False) else "first") if prefix else "never"
    backend.normalizer = None
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()]
    backend.decoder = tokenizers.decoders.Sequence(steps + ([tokenizers.decoders.Strip(" ", 1, 0)] if prefix else []))


def model_eos_token_ids(model_dir: Path) -> list[int]:
    """The ids that end a model's output beside its tokenizer's eos token, as transformers' `generate` and vLLM read
    them: generation_config.json's where that file exists (config.json's are then not read), else config.json's
    and its text_config's."""
    if (model_dir / "generation_config.json").is_file():
        return _int_list(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
    model_config = _read_json(model_dir / "config.json")
    return [*_int_list(model_config.get("eos_token_id")),
            *_int_list((model_config.get("text_config") or {}).get("eos_token_id"))]


def lone_surrogate_error(text: str, label: str) -> str | None:
    """The error for `text` (`label` names it) holding a lone surrogate, which Python's and JSON's strings allow and
    no tokenizer can encode; None for valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"{label} holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}: text must be "
                "valid Unicode")
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """Special tokens are written as a string or as a serialized AddedToken dict."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _int_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _first_token(backend: tokenizers.Tokenizer, *configs: Mapping[str, Any], key: str) -> str | None:
    for config in configs:
        token_ids = _int_list(config.get(key))
        if token_ids:
            return backend.id_to_token(token_ids[0])
    return None


def _read_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The chat templates by name, as a transformers tokenizer reads them: chat_template.jinja (the default) and
    additional_chat_templates/NAME.jinja, else tokenizer_config.json's (a string, or a list of named ones); a
    processor's chat_template.json only where the tokenizer has none (vLLM's fallback)."""
    template = tokenizer_config.get("chat_template")
    if template is None:
        template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates, as older configs store them
        templates = {entry["name"]: entry["template"] for entry in template}
    else:
        templates = {} if template is None else {"default": template}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        templates |= {path.stem: path.read_text(encoding="utf-8") for path in sorted(extra.glob("*.jinja"))}
    return templates


def _validated_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must contain at least one message")
    validated = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{index}] has no {key!r}")
        if not isinstance(message["role"], str):
            raise TypeError(f"messages[{index}]['role'] must be a str, got {type(message['role']).__name__}")
        content = message["content"]
        # a string, or a list of parts (dicts) for templates that walk them, as transformers takes it
        if not isinstance(content, str) and not (isinstance(content, (list, tuple))
                                                 and all(isinstance(part, Mapping) for part in content)):
            raise TypeError(f"messages[{index}]['content'] must be a str or a list of parts (dicts), got "
                            f"{type(content).__name__}")
        # Like transformers: templates handle a missing key better than a None value.
        message = {key: value for key, value in message.items() if value is not None}
        # and its aliases of an assistant turn's reasoning: reasoning_content, and thinking (GPT-OSS's templates)
        reasoning = next((message[key] for key in ("reasoning_content", "thinking", "reasoning") if key in message),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        validated.append(message)
    return validated


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' (render_jinja_template)


def _cut_at_continue_tag(text: str) -> str:
    """The rendered chat up to the tag after the last message's content: where the template kept the tag's space,
    just before it; where it trimmed the message, before the tag, without the whitespace it left (a search for the
    content itself found it in earlier messages or in the template's own markers)."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not render the last message's text as it is; "
                         "it cannot be continued")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.Environment:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


@lru_cache(maxsize=16)
def _compile_chat_template(chat_template: str) -> jinja2.Template:
    return _environment().from_string(chat_template)


@lru_cache(maxsize=16)
def template_reads_content_parts(chat_template: str) -> bool:
    """Whether a chat template walks a message's content as OpenAI's list of parts (`{% for part in
    message['content'] %}`: Llama 3.1's, Gemma 3's, Mistral Small 3's), which vLLM then passes it as ("openai"
    content format); otherwise the template reads one string, and the parts' texts are joined ("string")."""
    try:
        tree = _environment().parse(chat_template)
    except jinja2.exceptions.TemplateSyntaxError:
        return False
    names = {"content"}  # variables that hold a message's content
    for assign in tree.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _is_content(assign.node, names):
            names.add(assign.target.name)
    return any(_is_content(loop.iter, names) for loop in tree.find_all(jinja2.nodes.For))


def _is_content(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """`x.content`, `x['content']` or a name in `names`, filtered, tested or sliced."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        return node.name in names
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content")
