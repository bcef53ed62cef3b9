"""Which checkpoints a stage keeps: step 0 always, and enough of the newest that the stage furthest
ahead still holds the newest one of the stage furthest behind."""
from nebula.runtime.checkpoint import CheckpointDir, checkpoints_to_keep


def test_step_0_and_the_newest_are_kept(tmp_path):
    checkpoints = CheckpointDir(tmp_path, keep=3)
    for step in range(7):
        checkpoints.save(step, {"step": step})
    assert checkpoints.steps() == [0, 4, 5, 6]
    assert checkpoints.load(0) == {"step": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-{s:08d}.pt{ext}" for s in (0, 4, 5, 6) for ext in ("", ".sha256")]


def test_a_sender_far_ahead_keeps_as_many_as_it_may_lead_by():
    assert checkpoints_to_keep(stages=2, horizon=3, checkpoint_every=3) == 3  # the usual: 3
    assert checkpoints_to_keep(stages=2, horizon=5, checkpoint_every=1) == 7  # 5 steps ahead, each saved
    assert checkpoints_to_keep(stages=3, horizon=5, checkpoint_every=1) == 12  # 5 per link of the chain
    assert checkpoints_to_keep(stages=5, horizon=4, checkpoint_every=100) == 3
