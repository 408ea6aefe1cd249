"""metrics.jsonl and TensorBoard hold each step once when a run resumes, starts afresh or rolls back."""

from __future__ import annotations

import json
import struct

import pytest

from helpers import MetricsOnAFullDisk
from ushard import metrics
from ushard.errors import UserError
from ushard.metrics import MetricsWriter, drop_after


def _steps(workdir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())]


def _run(workdir, steps, offset=0.0, **kwargs) -> MetricsWriter:
    writer = MetricsWriter(str(workdir), **kwargs)
    for step in steps:
        writer.write({"step": step, "loss": offset + step, "ok": True})
    return writer


def test_without_a_resume_step_it_appends_as_before(tmp_path):
    _run(tmp_path, [1, 2, 3]).close()
    _run(tmp_path, [2, 3], offset=100).close()
    assert _steps(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.0), (2, 102.0), (3, 103.0)]


def test_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    _run(tmp_path, [2, 4, 6, 8]).close()
    _run(tmp_path, [6, 8, 10], offset=100, resume_step=4).close()
    assert _steps(tmp_path) == [(2, 2.0), (4, 4.0), (6, 106.0), (8, 108.0), (10, 110.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tensorboard"]  # no temporary left


def test_a_fresh_start_drops_every_earlier_step(tmp_path):
    _run(tmp_path, [1, 2, 3]).close()
    _run(tmp_path, [1, 2], offset=100, resume_step=0).close()
    assert _steps(tmp_path) == [(1, 101.0), (2, 102.0)]


def test_a_new_workdir_gets_a_new_file(tmp_path):
    _run(tmp_path / "new", [1], resume_step=0).close()
    assert _steps(tmp_path / "new") == [(1, 1.0)]


def test_rewind_after_a_rollback_within_the_run(tmp_path):
    writer = _run(tmp_path, [1, 2, 3, 4, 5], resume_step=0)
    writer.rewind(3)  # rolled back to the checkpoint at step 3
    for step in (4, 5, 6):
        writer.write({"step": step, "loss": 100.0 + step})
    writer.close()
    assert _steps(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0), (6, 106.0)]


def test_drop_after_keeps_foreign_lines_and_drops_a_line_cut_off_by_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1}\n# a note\n{"step": 2, "loss": 2}\n{"step": 3, "loss": 3}\n{"step": 4, "lo')
    assert drop_after(str(path), 2) == 2
    assert path.read_text() == '{"step": 1, "loss": 1}\n# a note\n{"step": 2, "loss": 2}\n'
    assert drop_after(str(path), 2) == 0  # nothing to drop: the file is left alone
    path.write_text('{"step": 1, "loss": 1}')  # kept, and given the newline the next record needs
    assert drop_after(str(path), 2) == 0 and path.read_text() == '{"step": 1, "loss": 1}\n'
    assert drop_after(str(tmp_path / "missing.jsonl"), 0) == 0


def test_only_process_0_writes(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 5}\n')
    monkeypatch.setattr(metrics.jax, "process_index", lambda: 1)
    _run(tmp_path, [1], resume_step=0).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 5, "loss": 5}\n'
    assert not (tmp_path / "tensorboard").exists()


# --------------------------------------------------------------------------- TensorBoard


def _events(path) -> list:
    """The Event protos of one TFRecord file: u64 length, u32 crc, data, u32 crc per record."""
    from tensorboardX.proto.event_pb2 import Event

    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        events.append(Event.FromString(data[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return events


def _summary(event):
    """(kind, step, value) of one event: 'start' for a session start, the tag for a scalar."""
    if event.HasField("session_log"):
        return ("start", event.step, None)
    if event.HasField("summary"):
        value = event.summary.value[0]
        return (value.tag, event.step, value.simple_value)
    return None


def test_tensorboard_is_told_to_hide_the_steps_after_the_checkpoint(tmp_path):
    _run(tmp_path, [2, 4, 6]).close()
    _run(tmp_path, [6, 8], offset=100, resume_step=4).close()
    files = sorted((tmp_path / "tensorboard").iterdir())
    assert len(files) == 2  # one per writer, in the order written
    seen = [[s for s in map(_summary, _events(f)) if s] for f in files]
    assert seen[0] == [("loss", 2, 2.0), ("loss", 4, 4.0), ("loss", 6, 6.0)]
    assert seen[1] == [("start", 5, None), ("start", 5, None), ("loss", 6, 106.0), ("loss", 8, 108.0)]


def test_two_writers_in_one_second_keep_separate_files(tmp_path):
    writer = _run(tmp_path, [1, 2], resume_step=0)
    writer.rewind(1)
    writer.close()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2


@pytest.mark.parametrize("loader", ["event_accumulator", "plugin_event_accumulator"])
def test_tensorboard_shows_each_step_once(tmp_path, loader):
    # TensorBoard's own Python loaders, where tensorboard is installed (it is not a dependency).
    module = pytest.importorskip(f"tensorboard.backend.event_processing.{loader}")
    _run(tmp_path, [1, 2, 3, 4, 5, 6]).close()  # an older ushard: no session start written
    writer = _run(tmp_path, [5, 6, 7], offset=100, resume_step=4)
    writer.rewind(5)
    for step in (6, 7, 8):
        writer.write({"step": step, "loss": 200.0 + step})
    writer.close()
    acc = module.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    if loader == "event_accumulator":
        shown = [(e.step, e.value) for e in acc.Scalars("loss")]
    else:
        from tensorboard.util import tensor_util

        shown = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors("loss")]
    assert shown == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 206.0), (7, 207.0), (8, 208.0)]


def test_a_full_disk_is_one_sentence_and_closing_afterwards_is_quiet(tmp_path):
    writer = _run(tmp_path, [1, 2])
    writer._jsonl = MetricsOnAFullDisk(writer._jsonl, step=3)
    with pytest.raises(UserError) as stopped:
        writer.write({"step": 3, "loss": 3.0})
    assert str(stopped.value) == (
        f"could not write the metrics of step 3 to {tmp_path / 'metrics.jsonl'} (No space left on device); the run "
        f"stopped there. Make room (or fix the directory) and run the same command to resume from the last checkpoint.")
    writer.close()  # nothing more to say
    writer.write({"step": 4, "loss": 4.0})  # nor to write
    assert _steps(tmp_path) == [(1, 1.0), (2, 2.0)]


def test_a_rewound_writer_goes_on_writing(tmp_path):
    writer = _run(tmp_path, [1, 2, 3])
    writer.rewind(2)
    writer.write({"step": 3, "loss": 30.0})
    writer.close()
    assert _steps(tmp_path) == [(1, 1.0), (2, 2.0), (3, 30.0)]
