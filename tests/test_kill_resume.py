"""kill -9 at random moments (one inside a checkpoint write at least), the same command each time:
the run ends bit-identical to an uninterrupted one, metrics.jsonl holding every step once with
its values (tests/kill_resume.py, here with 1 kill, inside a checkpoint write); and the logs cut back on resume, checked
on hand-made files (a cut last line, a cut TensorBoard record read back with TensorBoard's own
reader)."""
import json
import os
import struct
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import kill_resume  # noqa: E402

from fot_jax.train.loop import trim_event_files, trim_metrics  # noqa: E402


def test_sigkill_anywhere_then_the_same_command_ends_as_an_uninterrupted_run(tmp_path):
  summary = kill_resume.kill_and_resume(str(tmp_path), kills=1, in_write=1, seed=0, steps=8, sleep=0.1)
  assert summary["kills"] >= 1 and summary["kills_inside_checkpoint_writes"] >= 1, summary
  assert not any(r["ended_before_kill"] for r in summary["records"]), summary["records"]
  assert summary["params_identical"] and summary["metrics_identical"], summary["problems"]
  steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
  assert steps == list(range(1, 9))  # every step exactly once
  assert not [n for n in os.listdir(tmp_path / "killed" / "checkpoints") if "tmp" in n]  # leftovers deleted


def test_resume_cuts_metrics_and_tensorboard_back_to_the_restored_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
  path.write_text("\n".join(lines) + "\n" + '{"step": 7, "lo')  # a kill mid-line
  assert trim_metrics(str(path), 4) == 3
  assert path.read_text() == "\n".join(lines[:4]) + "\n"
  assert trim_metrics(str(path), 4) == 0
  path.write_text(lines[0])  # a whole record that lost its newline: the next append must not join it
  assert trim_metrics(str(path), 4) == 0 and path.read_text() == lines[0] + "\n"

  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.compat.tensorflow_stub import errors
  from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
  from tensorboard.summary.writer.record_writer import RecordWriter  # TensorBoard's framing, without TensorFlow
  tb, name = tmp_path / "tb", "events.out.tfevents.1.host"
  tb.mkdir()
  with open(tb / name, "wb") as f:
    writer = RecordWriter(f)
    writer.write(event_pb2.Event(file_version="brain.Event:2").SerializeToString())  # a file's header
    for s in range(1, 7):
      writer.write(event_pb2.Event(step=s, summary=summary_pb2.Summary(
          value=[summary_pb2.Summary.Value(tag="loss", simple_value=1.0 / s)])).SerializeToString())
    f.write(struct.pack("<Q", 40) + b"\x00" * 6)  # a record cut by a kill
  assert trim_event_files(str(tb), 4) == 3

  reader, events = PyRecordReader_New(str(tb / name)), []
  while True:
    try:
      reader.GetNext()  # checks both CRCs of every record
    except errors.OutOfRangeError:
      break
    events.append(event_pb2.Event.FromString(reader.record()))
  assert events[0].file_version.startswith("brain.Event")
  kept = [(e.step, e.summary.value[0].simple_value) for e in events[1:]]
  assert kept == [(s, float(np.float32(1.0 / s))) for s in range(1, 5)]
