import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from torch_shift.models.toy import build_tokenizer
from torch_shift.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "café naïve über 你好世界 😀 🚀 👍🏽",
    "def forward(self, x):\n    return x * 2  # 東京",
    "  leading and trailing spaces  ",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 😀 你好"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Write  code."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo → 東京 ☀️"}}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def copy_dir(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def edit_json(path: Path, **changes) -> None:
    content = json.loads(path.read_text())
    content.update(changes)
    path.write_text(json.dumps(content))


def test_build_tokenizer_has_exact_vocab_size_and_is_deterministic(tmp_path: Path) -> None:
    for vocab_size in (262, 512, 1000):
        out_dir = build_tokenizer(tmp_path / str(vocab_size), vocab_size=vocab_size)
        assert len(Tokenizer.from_dir(out_dir)) == vocab_size
    # The corpus yields fewer than 1000 tokens; the padding tokens decode to visible text.
    assert Tokenizer.from_dir(tmp_path / "1000").decode([999]) == "<extra_999>"
    again = build_tokenizer(tmp_path / "again", vocab_size=512)
    assert (again / "tokenizer.json").read_bytes() == (tmp_path / "512" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path / "too_small", vocab_size=100)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_token_attributes(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_ids) == ("</s>", frozenset({1}))
    assert tokenizer.pad_token_id == 3
    assert tokenizer.vocab_size == 512


def test_bos_is_added_exactly_once(tokenizer: Tokenizer) -> None:
    assert tokenizer.add_bos_token
    for text in ("Hello", "", "<s>Hello"):
        token_ids = tokenizer.encode(text)
        assert token_ids[0] == tokenizer.bos_token_id
        assert token_ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.bos_token_id not in tokenizer.encode("Hello", add_special_tokens=False)


def test_bos_from_tokenizer_config_when_post_processor_adds_none(tokenizer_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    edit_json(model_dir / "tokenizer.json", post_processor=None)
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.add_bos_token
    assert tokenizer.encode("Hello")[0] == tokenizer.bos_token_id
    assert tokenizer.encode("<s>Hello").count(tokenizer.bos_token_id) == 1

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert not tokenizer.add_bos_token
    assert tokenizer.bos_token_id not in tokenizer.encode("Hello")


def test_add_bos_token_inferred_from_post_processor(tokenizer_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.add_bos_token
    assert tokenizer.encode("Hello").count(tokenizer.bos_token_id) == 1


def test_eos_token_ids_are_the_generation_configs_else_the_configs(tokenizer_dir: Path, tmp_path: Path) -> None:
    """As transformers' generate and vLLM read them: config.json's ids are not read beside a generation_config.json
    (a union stopped outputs that both go on with)."""
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    edit_json(model_dir / "tokenizer_config.json", eos_token={"content": "</s>", "special": True})
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5], "bos_token_id": 0}))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.eos_token_ids == frozenset({1, 5})
    assert tokenizer.eos_token == "</s>"
    (model_dir / "generation_config.json").unlink()
    assert Tokenizer.from_dir(model_dir).eos_token_ids == frozenset({1, 7})  # the tokenizer's own and config.json's


def test_special_tokens_fall_back_to_config_ids(tokenizer_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    (model_dir / "tokenizer_config.json").unlink()
    (model_dir / "special_tokens_map.json").unlink()
    (model_dir / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [5, 1], "pad_token_id": 3}))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.pad_token_id) == ("<s>", 0, 3)
    assert tokenizer.eos_token_ids == frozenset({1, 5})
    assert tokenizer.chat_template is None


def test_missing_tokenizer_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("tokenize", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer, tokenize: bool, add_generation_prompt: bool
) -> None:
    for kwargs in ({}, {"tools": TOOLS}):
        ours = tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
        )
        reference = hf_tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=False, **kwargs
        )
        assert ours == reference
    if tokenize:
        assert ours.count(tokenizer.bos_token_id) == 1


def test_chat_template_jinja_file_overrides_tokenizer_config(tokenizer_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    # Multi-line, indented blocks depend on trim_blocks/lstrip_blocks; also uses break, strftime_now and tools.
    template = """{{ bos_token }}Today is {{ strftime_now('%Y') }}.
{% for message in messages %}
    {% if loop.index > 3 %}{% break %}{% endif %}
[{{ message.role | upper }}] {{ message.content }}{{ eos_token }}
{% endfor %}
    {% if tools is not none %}
{{ tools | tojson(indent=2) }}
    {% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""
    (model_dir / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_dir(model_dir)
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == template
    for kwargs in ({}, {"tools": TOOLS}):
        ours = tokenizer.apply_chat_template(MESSAGES, **kwargs)
        assert ours == reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)


def test_chat_template_raise_exception(tokenizer: Tokenizer) -> None:
    with pytest.raises(Exception, match="Unknown role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_no_chat_template_raises(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(build_tokenizer(tmp_path, chat_template=False))
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(MESSAGES)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "user"}],
        [{"content": "hello"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": ["hello"]}],
        [("user", "hello")],
        None,
    ],
)
def test_malformed_messages_raise(tokenizer: Tokenizer, messages) -> None:
    with pytest.raises((ValueError, TypeError)):
        tokenizer.apply_chat_template(messages)


def test_decode_skip_special_tokens(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert tokenizer.decode(token_ids) == "user\nHi\nassistant\n"
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == (
        "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.token_to_str(tokenizer.bos_token_id) == "<s>"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello", add_special_tokens=False)) == ["H", "e", "ll", "o"]


def detokenize(tokenizer: Tokenizer, prompt_ids: list[int], generated_ids: list[int], skip: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    chunks = [detokenizer.step(token_id) for token_id in generated_ids]
    assert detokenizer.output_text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt_ids = tokenizer.encode("Tell me something:")
    generated_ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = detokenize(tokenizer, prompt_ids, generated_ids)
    assert "".join(chunks) == tokenizer.decode(generated_ids)
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_incremental_detokenizer_holds_back_split_characters(tokenizer: Tokenizer) -> None:
    generated_ids = tokenizer.encode(" 😀你", add_special_tokens=False)
    # The byte-level tokens split both characters, so decoding them one by one gives replacement characters.
    assert any("\ufffd" in tokenizer.token_to_str(token_id) for token_id in generated_ids)
    chunks = detokenize(tokenizer, tokenizer.encode("Hi"), generated_ids)
    assert [chunk for chunk in chunks if chunk] == [" 😀", "你"]
    assert chunks[0] == ""


def test_incremental_detokenizer_after_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Hi 😀 ok", add_special_tokens=False)
    split = next(i for i in range(1, len(token_ids)) if tokenizer.decode(token_ids[:i]).endswith("\ufffd"))
    chunks = detokenize(tokenizer, token_ids[:split], token_ids[split:])
    assert "".join(chunks) == tokenizer.decode(token_ids[split:])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_random_ids(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    for _ in range(200):
        prompt_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 10))]
        generated_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        chunks = [detokenizer.step(token_id) for token_id in generated_ids]
        chunks.append(detokenizer.flush())
        assert "".join(chunks) == tokenizer.decode(generated_ids, skip_special_tokens=skip_special_tokens)
        assert detokenizer.output_text == "".join(chunks)


def test_incremental_detokenizer_skip_special_tokens(tokenizer: Tokenizer) -> None:
    generated_ids = [*tokenizer.encode("Hi", add_special_tokens=False), 5, 1]
    assert "".join(detokenize(tokenizer, [0], generated_ids)) == "Hi"
    assert "".join(detokenize(tokenizer, [0], generated_ids, skip=False)) == "Hi<|im_end|></s>"


def test_flush_ends_detokenization(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    first_byte_of_emoji = tokenizer.encode("😀", add_special_tokens=False)[0]
    assert detokenizer.step(first_byte_of_emoji) == ""
    assert detokenizer.flush() == "\ufffd"
    with pytest.raises(RuntimeError):
        detokenizer.step(first_byte_of_emoji)


def test_incremental_detokenizer_keeps_sentencepiece_leading_space(tmp_path: Path) -> None:
    words = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "▁how", "▁are", "▁you"]
    backend = tokenizers.Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tokenizer = Tokenizer.from_dir(tmp_path)

    prompt_ids = [1, *tokenizer.encode("Hello world", add_special_tokens=False)]
    generated_ids = tokenizer.encode("how are you", add_special_tokens=False)
    # Decoded on its own, the first word loses its space; after the prompt it keeps it.
    assert tokenizer.decode(generated_ids) == "how are you"
    assert detokenize(tokenizer, prompt_ids, generated_ids) == [" how", " are", " you"]


def test_incremental_detokenizer_survives_non_monotonic_decoder(tmp_path: Path) -> None:
    backend = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "c": 3, "d": 4}, unk_token="<unk>"))
    # Fused "ab" decodes to nothing, so text emitted for "a" disappears later: DecodeStream raises "Invalid prefix".
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "")])
    backend.save(str(tmp_path / "tokenizer.json"))
    chunks = detokenize(Tokenizer.from_dir(tmp_path), [], [1, 2, 3, 4])
    assert "".join(chunks).endswith("d")


def test_chat_template_from_chat_template_json_or_named_list(tokenizer_dir: Path, tmp_path: Path) -> None:
    """As a transformers tokenizer reads them (a differential run found the tool_use template never used and a
    processor's chat_template.json taking the tokenizer's place)."""
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    hi = [{"role": "user", "content": "hi"}]
    edit_json(model_dir / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "{{ messages[0].content }} with {{ tools | length }} tools"},
        {"name": "default", "template": "{{ messages[0].content }}!"},
    ])
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.apply_chat_template(hi) == "hi!"
    assert tokenizer.apply_chat_template(hi, tools=[{"type": "function"}]) == "hi with 1 tools"  # transformers'
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0].role }}?"}))
    assert Tokenizer.from_dir(model_dir).apply_chat_template(hi) == "hi!"  # the tokenizer's own first
    edit_json(model_dir / "tokenizer_config.json", chat_template=None)
    assert Tokenizer.from_dir(model_dir).apply_chat_template(hi) == "user?"  # the processor's where it has none
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools[0].type }}")
    assert Tokenizer.from_dir(model_dir).apply_chat_template(hi, tools=[{"type": "function"}]) == "function"
    tokenizer.chat_template = "{{ messages[0].content }}."  # a server's --chat-template replaces every one
    assert tokenizer.apply_chat_template(hi, tools=[{"type": "function"}]) == "hi."


@pytest.mark.parametrize("template, messages, expected", [
    # a trimming template and a trailing-space prefill that an earlier message also holds: the cut was inside the
    # user's turn ("<user>Sure, ")
    ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}",
     [{"role": "user", "content": "Sure, tell me a story"}, {"role": "assistant", "content": "Sure, "}],
     "<user>Sure, tell me a story</s><assistant>Sure,"),
    # content that the template's own closing marker holds: the cut was after the marker's "<" ("<<")
    ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}",
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<"}], "<user>hi</s><assistant><"),
    ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}",  # whitespace is text to continue too
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}], "<user>hi</s><assistant> "),
])
def test_continue_final_message_cuts_where_transformers_does(tokenizer_dir: Path, tmp_path: Path, template, messages,
                                                             expected) -> None:
    """transformers marks the end of the last message with a tag before rendering (found by a differential run
    against its apply_chat_template; the search for the content found it in other places)."""
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    edit_json(model_dir / "tokenizer_config.json", chat_template=template)
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_content_parts_reach_the_templates_that_walk_them(tokenizer_dir: Path, tmp_path: Path) -> None:
    """vLLM's content formats: a template that loops over a message's content (Llama 3.1's, Gemma 3's) gets OpenAI's
    parts, others their texts joined with newlines (were joined for every template; a differential run found
    "Hello \nworld" where transformers renders the parts "Helloworld")."""
    from torch_shift.serve.tools import template_messages
    from torch_shift.tokenizer import template_reads_content_parts

    walks = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
             "{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endif %}{% endfor %}")
    assigned = ("{% for m in messages %}{% set c = m.content %}{% for p in c | reverse %}{{ p.text }}{% endfor %}"
                "{% endfor %}")
    reads = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    assert template_reads_content_parts(walks) and template_reads_content_parts(assigned)
    assert not template_reads_content_parts(reads) and not template_reads_content_parts("{% broken")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    tokenizers = []
    for i, (template, expected) in enumerate(((walks, "[a][b]"), (assigned, "ba"), (reads, "<a\nb>"))):
        model_dir = copy_dir(tokenizer_dir, tmp_path / f"model{i}")
        edit_json(model_dir / "tokenizer_config.json", chat_template=template)
        tok = Tokenizer.from_dir(model_dir)
        tokenizers.append(tok)
        messages = template_messages(parts, tok.reads_content_parts())
        assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    # continued after the last text part
    assert tokenizers[0].apply_chat_template(template_messages(parts, True), add_generation_prompt=False,
                                             continue_final_message=True) == "[a][b"


def _sentencepiece_style_dir(out: Path, **config) -> Path:
    """A tokenizer.json as Llama 2's and Mistral's are published (byte-fallback BPE, a normalizer that prepends "▁"
    and replaces spaces, a post-processor adding <s>), with tokenizer_config.json's class LlamaTokenizer."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    byte_pieces = [f"<0x{i:02X}>" for i in range(256)]
    corpus = ["the quick brown fox jumps over the lazy dog", "In the beginning God created the heaven"] * 50
    bpe.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_pieces], show_progress=False))
    bpe.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                      tokenizers.normalizers.Replace(" ", "▁")])
    bpe.pre_tokenizer = None
    bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse(),
        tokenizers.decoders.Strip(" ", 1, 0)])
    out.mkdir(parents=True)
    bpe.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, **config}))
    return out


@pytest.mark.parametrize("config", [{"legacy": True}, {"legacy": False}, {}, {"add_prefix_space": False}])
def test_a_llama_tokenizer_encodes_as_transformers_5_and_vllm(tmp_path: Path, config) -> None:
    """transformers 5's LlamaTokenizer rebuilds such a file's pipeline (and vLLM 0.32 reads it so): " x" was
    "<s> ▁ ▁x" here and "<s> ▁x" there, and a piece after a special token took a "▁" (found by a differential run)."""
    transformers = pytest.importorskip("transformers")
    model_dir = _sentencepiece_style_dir(tmp_path / "sp", **config)
    ours, theirs = Tokenizer.from_dir(model_dir), transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for text in ["the quick fox", " x", "a </s> b", "</s>In the", "   ", "the  lazy\n dog", "café 你好"]:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_reasoning_reaches_templates_under_its_aliases(tokenizer_dir: Path, tmp_path: Path) -> None:
    """transformers copies a turn's `reasoning` or `thinking` to `reasoning_content`, and to `thinking` (GPT-OSS's)."""
    model_dir = copy_dir(tokenizer_dir, tmp_path / "model")
    edit_json(model_dir / "tokenizer_config.json",
              chat_template="{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.content }};"
                            "{% endfor %}")
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    assert Tokenizer.from_dir(model_dir).apply_chat_template(turns, add_generation_prompt=False) == "||q;r|r|a;"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_rebuild_the_text_byte_level(tokenizer: Tokenizer, text: str) -> None:
    """A byte-level BPE's tokens of a character split over several of them each carry their own bytes (OpenAI's
    logprobs `bytes`), not the replacement character their text decodes to alone."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    (eos,) = tokenizer.eos_token_ids
    assert tokenizer.token_bytes(eos) == tokenizer.token_to_str(eos).encode()  # an added token: its text


def test_token_bytes_of_sentencepiece_byte_fallback(tmp_path: Path) -> None:
    """Llama 2's decoders (▁ as a space, byte-fallback pieces <0xHH>): a piece's bytes with its space, a byte piece's
    byte."""
    pieces = ["<unk>", "<s>", "</s>", "▁", "▁Hello", "▁world", *[f"<0x{b:02X}>" for b in range(256)]]
    backend = tokenizers.Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                                              byte_fallback=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    ids = tokenizer.encode("Hello world 日本", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == " Hello world 日本".encode()
    assert tokenizer.token_bytes(pieces.index("<0xE6>")) == b"\xe6"
    assert tokenizer.token_bytes(2) == b"</s>"


def _wordpiece_dir(out: Path) -> Path:
    """A BERT-style tokenizer: WordPiece pieces ("##" continues a word), whose decoder joins words with spaces."""
    backend = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog: observation, answer!"] * 50,
                                tokenizers.trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]", "[SEP]"],
                                                                     show_progress=False))
    backend.decoder = decoders.WordPiece()
    out.mkdir(parents=True)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[SEP]", "unk_token": "[UNK]"}))
    return out


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "wordpiece"])
def test_the_token_that_completes_a_stop_string_is_a_stop_string_token(tokenizer: Tokenizer, tmp_path: Path,
                                                                        kind: str) -> None:
    """Tokenizer.stop_string_token_ids holds the token at whose step the output processor finds a stop string (as
    OutputProcessor._detokenize: the incremental detokenizer's text, StopStrings), over random outputs and stop
    strings cut from their own text, unless the detokenizer held text back before it or any token may (None: a stop
    string holding U+FFFD); a redrafting check ends after a stage that drew such a token, and one that starts with text
    held, or whose tokens are any, runs one stage: it never runs on past the stop. And they are a small part of the
    vocabulary."""
    from torch_shift.engine.output_processor import StopStrings

    if kind == "sentencepiece":
        tokenizer = Tokenizer.from_dir(_sentencepiece_style_dir(tmp_path / "sp"))
    elif kind == "wordpiece":
        tokenizer = Tokenizer.from_dir(_wordpiece_dir(tmp_path / "wp"))
    rng = random.Random(0)
    words = ["the", " quick", " brown", "\n", ": ", "Observation", " café", " 你好", " 😀", "!", "  ", "fox"]
    num_found = num_held = 0
    for trial in range(300):
        if trial % 2:
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(24)]
        else:
            ids = tokenizer.encode("".join(rng.choice(words) for _ in range(12)), add_special_tokens=False)
        skip = trial % 3 != 0
        text = tokenizer.decode(ids, skip_special_tokens=skip)
        if not text.strip():
            continue
        stops = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randrange(1, 7)])
        enders = tokenizer.stop_string_token_ids(stops)
        detokenizer = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id or 0], skip)
        finder, seen = StopStrings(tuple(stops)), ""
        for i, token_id in enumerate(ids):
            held = detokenizer.holds_text
            new_text = detokenizer.step(token_id)
            seen += new_text
            if new_text and finder.find(seen, len(new_text)) is not None:
                assert enders is None or token_id in enders or held, (kind, stops, ids[:i + 1], seen)
                num_found += 1
                num_held += held or enders is None
                break
    assert num_found - num_held >= 100, (num_found, num_held)  # found with no text held, among listed tokens
    assert len(tokenizer.stop_string_token_ids(["Observation:"])) < tokenizer.vocab_size // 10
    assert tokenizer.stop_string_token_ids(["a\ufffd"]) is None  # any token: U+FFFD comes from no token's bytes
