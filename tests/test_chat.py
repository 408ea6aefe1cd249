"""Fine-tuning data: conversations and prompt / completion records, their loss masks, packing and
truncation, the Hugging Face chat template, bad input, a run that only learns with the mask, and
every layout matching one device on masked batches."""

import json
import random

import jax
import numpy as np
import pytest

import ushard
from conftest import SMALL_MOE, data_config, small_config
from helpers import assert_same_training, run_config
from ushard.cli import main
from ushard.data import make_batches
from ushard.data.chat import BYTE_ANSWER_PROMPT, ByteTemplate, FitCounts, fit_window
from ushard.data.packing import best_fit_windows
from ushard.data.tokenizer import ByteTokenizer
from ushard.errors import UserError
from ushard.training.loop import Trainer

EOS = ByteTokenizer.eos_id


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def conversation(*turns):
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def counted_text(batch) -> list[str]:
    """Per row, the target bytes the loss counts, runs of them joined, "|" between runs."""
    rows = []
    for targets, mask in zip(batch["targets"], batch["loss_mask"]):
        runs, run = [], ""
        for t, m in zip(targets, mask):
            if m:
                run += "<EOS>" if t == EOS else chr(t)
            elif run:
                runs.append(run)
                run = ""
        rows.append("|".join(runs + ([run] if run else [])))
    return rows


# --------------------------------------------------------------------------- the byte template and the mask


def test_byte_template_counts_the_assistant_turns_and_their_end_token():
    example = ByteTemplate(ByteTokenizer()).example(conversation("hi", "hello!", "more?", "no.")["messages"], "x")
    text = bytes(int(t) if t < 256 else ord("#") for t in example.tokens).decode()
    assert text == "<|user|>\nhi\n<|assistant|>\nhello!#<|user|>\nmore?\n<|assistant|>\nno.#"
    counted = "".join(c for c, m in zip(text, example.counted) if m)
    assert counted == "hello!#no.#"
    assert example.turn_ends == [12, 33, 48, 66]
    assert BYTE_ANSWER_PROMPT == "<|assistant|>\n"


def test_batches_count_only_assistant_tokens_and_keep_conversations_whole(tmp_path):
    rng = random.Random(0)
    records = [conversation("".join(rng.choice("xyz") for _ in range(rng.randint(1, 20))), f"answer {i}")
               for i in range(40)]
    cfg = data_config(source="chat", paths=write_jsonl(tmp_path / "c.jsonl", records), eval_fraction=0.1)
    batches = make_batches(cfg, 63, seed=0)
    batch, _ = batches.train_batch(batches.initial_state(), batches.train.epoch_tokens // 64)  # one epoch
    answers = [run for row in counted_text(batch) for run in row.split("|") if run]
    held = [f"answer {i}" for i, name in enumerate(batches.corpus.names)
            if batches.pieces.held_out[i]]
    # Every training conversation's answer and its end token, once: nothing cut, nothing else counted.
    assert sorted(answers) == sorted(f"answer {i}<EOS>" for i in range(40) if f"answer {i}" not in held)
    # Each conversation starts a segment at position 0, and the padding is a segment of its own.
    inputs, segments, positions = batch["inputs"], batch["segment_ids"], batch["positions"]
    starts = np.argwhere(positions == 0)
    assert all(bytes(inputs[r, c:c + 8].astype(np.uint8)) in (b"<|user|>", bytes(8)) for r, c in starts)
    assert np.all(np.diff(segments, axis=1) >= 0)
    assert "conversations used" in batches.summary() and "padding" in batches.summary()
    # The metrics' token count is the mask's.
    assert int(batch["loss_mask"].sum()) == sum(len(a) - len("<EOS>") + 1 for a in answers)


def test_train_on_all_counts_every_token_but_padding_and_conversation_starts(tmp_path):
    records = [conversation("abc" * (i % 5 + 1), "ok") for i in range(20)]
    cfg = data_config(source="chat", paths=write_jsonl(tmp_path / "c.jsonl", records), train_on="all")
    batches = make_batches(cfg, 63, seed=0)
    batch, _ = batches.train_batch(batches.initial_state(), 4)
    for row in range(4):
        segments, mask = batch["segment_ids"][row], batch["loss_mask"][row]
        next_starts = np.append(segments[1:] != segments[:-1], False)
        padding = batch["targets"][row] == 0  # byte 0 is in no conversation here
        assert padding.any()
        np.testing.assert_array_equal(mask.astype(bool), ~next_starts & ~padding)


def test_prompt_completion_records_count_the_completion_and_its_end(tmp_path):
    records = [{"q": f"question {i}? ", "a": f"reply {i}", "text": "unused"} for i in range(12)]
    cfg = data_config(source="jsonl", paths=write_jsonl(tmp_path / "p.jsonl", records), prompt_field="q",
                      completion_field="a", eval_fraction=0.2)
    batches = make_batches(cfg, 40, seed=1)
    batch, _ = batches.train_batch(batches.initial_state(), batches.train.epoch_tokens // 41)
    runs = sorted(run for row in counted_text(batch) for run in row.split("|") if run)
    assert runs and all(run.startswith("reply ") and run.endswith("<EOS>") for run in runs)


# --------------------------------------------------------------------------- fitting and packing


def test_a_long_conversation_is_cut_after_the_last_whole_turn_that_fits():
    example = ByteTemplate(ByteTokenizer()).example(conversation("a", "bb", "c", "dd", "e", "ff")["messages"], "x")
    ends = example.turn_ends
    counts = FitCounts()
    cut = fit_window(example, ends[3] + 5, False, counts)  # fits four turns and part of the fifth
    assert len(cut.tokens) == ends[3] and cut.turn_ends == ends[:4]
    assert counts.at_turn == 1
    # No turn boundary with a counted token before it fits: cut at the window.
    cut = fit_window(example, ends[1] - 1, False, counts)  # the first answer without its end token
    assert len(cut.tokens) == ends[1] - 1 and counts.mid_turn == 1
    # Nothing counted fits: skipped.
    assert fit_window(example, ends[0] + 3, False, counts) is None and counts.skipped == 1
    whole = fit_window(example, 10_000, False, counts)
    assert len(whole.tokens) == len(example.tokens) and counts.whole == 1


def test_best_fit_windows_place_every_piece_once_within_the_window():
    lengths = np.random.default_rng(0).integers(1, 65, size=500)
    windows = best_fit_windows(lengths, 65)
    assert sorted(p for w in windows for p in w) == list(range(500))
    assert all(sum(lengths[w]) <= 65 for w in windows)
    assert len(windows) <= 1.05 * lengths.sum() / 65 + 1  # best-fit decreasing packs them tightly


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("content, message", [
    ('{"messages": [{"role": "robot", "content": "hi"}]}\n', r"message 1 has role 'robot'; the roles are system, "
                                                            r"user, assistant and tool\.$"),
    ("", r"holds no conversation; remove it from data.paths or fill it\.$"),
    ('{"messages": "hi"}\n', r"is not a JSON object with a non-empty \"messages\" list"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}\n{"messages": [{"role": "user", "content": '
     '"another"}]}\n', r"holds no usable conversations: 0 of 2 conversations used"),
])
def test_bad_chat_files_stop_with_one_sentence(tmp_path, content, message):
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        make_batches(data_config(source="chat", paths=str(tmp_path / "c.jsonl")), 63, 0)


def test_a_file_without_a_usable_conversation_stops_the_run(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [conversation("q", "a")] * 3)
    write_jsonl(tmp_path / "questions.jsonl", [{"messages": [{"role": "user", "content": "only a question"}]}] * 2)
    with pytest.raises(UserError, match=r"questions.jsonl holds no usable conversations: none of its 2 has a token "
                                        r"that counts in the loss \(data.train_on='assistant'\)"):
        make_batches(data_config(source="chat", paths=f"{good},{tmp_path / 'questions.jsonl'}"), 63, 0)


def test_the_cli_reports_a_bad_conversation_in_one_line(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "wizard", "content": "hi"}]}\n')
    status = main(["train", "--config", "tiny", "--workdir", str(tmp_path / "run"), "--config.data.source=chat",
                   f"--config.data.paths={tmp_path / 'c.jsonl'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "has role 'wizard'" in err[0]


@pytest.mark.parametrize("overrides, message", [
    ({"data.prompt_field": "q"}, r"go together: set both"),
    ({"data.source": "text", "data.paths": "x", "data.prompt_field": "q", "data.completion_field": "a"},
     r"name fields of jsonl or parquet records"),
    ({"data.source": "chat", "data.paths": "x", "data.chunk_tokens": 100}, r"packed whole; leave it 0"),
    ({"data.train_on": "prompt"}, r"data.train_on='prompt' is not valid"),
])
def test_fine_tuning_settings_are_checked(overrides, message):
    with pytest.raises(UserError, match=message):
        ushard.load_config("tiny", overrides)


# --------------------------------------------------------------------------- a Hugging Face chat template

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A small byte-level BPE tokenizer with ChatML's special tokens and template, saved as Hugging Face does."""
    tokenizers = pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("chatml")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                             "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["user assistant system hello there how are you today fine thanks"] * 20, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "how are you"}, {"role": "user", "content": "fine thanks"},
            {"role": "assistant", "content": "today fine"}]


def test_hugging_face_template_renders_as_transformers_does(chatml_tokenizer):
    transformers = pytest.importorskip("transformers")
    from ushard.data.chat import HFChatTemplate
    from ushard.data.tokenizer import get_tokenizer

    ours = HFChatTemplate(get_tokenizer(str(chatml_tokenizer)))
    theirs = transformers.AutoTokenizer.from_pretrained(str(chatml_tokenizer))
    for messages, prompt in ((MESSAGES, False), (MESSAGES[:2], True)):
        assert ours.render(messages, prompt) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=prompt)
    example = ours.example(MESSAGES, "x")
    expected = theirs.apply_chat_template(MESSAGES, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert example.tokens.tolist() == list(expected)
    # The counted tokens are the assistant turns, each with its end token and newline.
    counted = theirs.decode(example.tokens[example.counted].tolist())
    assert counted == "how are you<|im_end|>\ntoday fine<|im_end|>\n"


def test_a_template_that_fails_to_render_stops_with_one_sentence(chatml_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "tool", "content": "x"},
                                                            {"role": "assistant", "content": "y"}]}] * 2)
    cfg = data_config(source="chat", paths=path, tokenizer=str(chatml_tokenizer))
    with pytest.raises(UserError, match=r"chat template in .*tokenizer_config.json failed to render the "
                                        r"conversation .*c.jsonl:1 \(bad role\)\.$"):
        make_batches(cfg, 63, 0)


def test_a_tokenizer_without_a_template_is_refused(chatml_tokenizer, tmp_path):
    directory = tmp_path / "plain"
    directory.mkdir()
    (directory / "tokenizer.json").write_text((chatml_tokenizer / "tokenizer.json").read_text())
    path = write_jsonl(tmp_path / "c.jsonl", [conversation("hello", "there")] * 2)
    with pytest.raises(UserError, match=r"has no chat template"):
        make_batches(data_config(source="chat", paths=path, tokenizer=str(directory)), 63, 0)


# --------------------------------------------------------------------------- training


def masking_run(tmp_path, train_on, steps, batch_size):
    """`tiny` on a chat file whose user turns are random letters and whose answers are all the same:
    the answer is learnable, the questions are not."""
    rng = random.Random(0)
    records = [conversation("".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(60, 100))),
                            "Noted.") for _ in range(400)]
    path = write_jsonl(tmp_path / f"{train_on}.jsonl", records)
    config = ushard.load_config("tiny", {
        "data.source": "chat", "data.paths": path, "data.train_on": train_on, "train.steps": steps,
        "train.log_every": 5, "train.eval_every": 0, "train.batch_size": batch_size, "train.warmup_steps": 5,
        "mesh.fsdp": 1})
    rows = Trainer(config, devices=jax.devices()[:1]).run(log=lambda *_: None)
    assert all(r["loss_tokens"] > 0 for r in rows)
    return rows


def check_masking_runs(tmp_path, steps, batch_size):
    masked = masking_run(tmp_path, "assistant", steps, batch_size)
    assert masked[-1]["loss"] < 0.5
    everything = masking_run(tmp_path, "all", steps, batch_size)
    assert all(r["loss"] > 2 for r in everything)
    # The mask counts a few answer tokens a row; "all" counts nearly every token.
    assert masked[-1]["loss_tokens"] * 10 < everything[-1]["loss_tokens"]


def test_the_answer_is_learnt_only_with_the_mask(tmp_path):
    check_masking_runs(tmp_path, steps=15, batch_size=8)


@pytest.mark.slow
def test_the_answer_is_learnt_only_with_the_mask_in_100_steps(tmp_path):
    check_masking_runs(tmp_path, steps=100, batch_size=16)


# --------------------------------------------------------------------------- layouts on masked batches

PIPELINE_1F1B = {"mesh.pipeline": 2, "parallel.pipeline_schedule": "1f1b", "parallel.pipeline_microbatches": 4}
LAYOUTS = {  # name: (config, overrides, devices); each compared with the first of its config
    "single": ("tiny", {}, 1),
    "fsdp8_accum2": ("tiny", {"mesh.fsdp": 8, "train.grad_accum": 2}, 8),
    "tensor2_fsdp4": ("tiny", {"mesh.tensor": 2, "mesh.fsdp": 4}, 8),
    "pipeline2_1f1b_fsdp2": ("tiny", {**PIPELINE_1F1B, "mesh.fsdp": 2}, 4),
    "single_moe": ("tiny_moe", SMALL_MOE, 1),
    "expert4_fsdp2_moe": ("tiny_moe", {**SMALL_MOE, "mesh.expert": 4, "mesh.fsdp": 2}, 8),
}


@pytest.fixture(scope="module")
def chat_batches(tmp_path_factory):
    rng = random.Random(1)
    words = lambda: " ".join(rng.choice(["ab", "cde", "f", "ghij"]) for _ in range(rng.randint(1, 6)))  # noqa: E731
    records = [conversation(words(), words(), *([words(), words()] if i % 4 == 0 else [])) for i in range(200)]
    path = write_jsonl(tmp_path_factory.mktemp("chat") / "c.jsonl", records)
    config = small_config(**chat_settings(path))
    return make_batches(config.data, config.train.seq_len, config.train.seed)


def chat_settings(path):
    return {"data.source": "chat", "data.paths": path, "train.seq_len": 96}


@pytest.fixture(scope="module")
def layout_results(chat_batches):
    cache = {}

    def result(name):
        if name not in cache:
            config_name, overrides, devices = LAYOUTS[name]
            config = small_config(config_name, **chat_settings(chat_batches.corpus.settings["paths"]), **overrides)
            cache[name] = run_config(config, jax.devices()[:devices], chat_batches)
        return cache[name]

    return result


def test_masked_batches_exercise_the_mask(chat_batches):
    batch, _ = chat_batches.train_batch(chat_batches.initial_state(), 16)
    counted = batch["loss_mask"].mean()
    assert 0.1 < counted < 0.6  # most targets are prompts, headers or padding
    assert (batch["segment_ids"].max(axis=1) >= 3).any()  # rows of two conversations and padding


# The default tier runs the layout whose mask path is the most involved (microbatches through the
# pipeline's ticks); the others' mask handling is the same loss_mask that tests/test_parallel_parity.py
# checks on every layout with document boundaries masked.
SLOW_LAYOUTS = ("fsdp8_accum2", "tensor2_fsdp4", "expert4_fsdp2_moe", "pipeline2_1f1b_fsdp2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n
                                  for n in LAYOUTS if not n.startswith("single")])
def test_masked_training_matches_one_device(layout_results, name):
    reference = "single_moe" if name.endswith("_moe") else "single"
    assert_same_training(layout_results(name), layout_results(reference))


def test_logged_token_count_is_the_mask_sum(tmp_path, chat_batches):
    config = small_config(**chat_settings(chat_batches.corpus.settings["paths"]), **{"train.steps": 2})
    rows = Trainer(config, devices=jax.devices()[:1], batches=chat_batches).run(log=lambda *_: None)
    state = chat_batches.initial_state()
    for row in rows:
        batch, state = chat_batches.train_batch(state, config.train.batch_size)
        assert row["loss_tokens"] == int(batch["loss_mask"].sum())


def test_a_resume_under_another_seq_len_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [conversation("q" * i, "a") for i in range(1, 30)])
    saved = make_batches(data_config(source="chat", paths=path), 63, 0).initial_state()
    with pytest.raises(UserError, match=r"made with train.seq_len=63 but this run has train.seq_len=95"):
        make_batches(data_config(source="chat", paths=path), 95, 0).check_resume(saved, restart=False)

