"""bench/train_step.py leaves no taps file behind in the temporary directory it picked itself."""
from __future__ import annotations

import tempfile

from dflash_jax.bench import train_step


def test_default_taps_directory_is_removed_after_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    record = train_step.run("tiny", layers=1, batch=1, seq_len=32, blocks=2, block_size=4, batches=1, iters=1,
                            taps_dir=None, modes=("disk",))
    assert record["modes"]["disk"]["median_ms"] > 0 and record["taps_file_gb"] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_given_taps_directory_is_kept(tmp_path):
    train_step.run("tiny", layers=1, batch=1, seq_len=32, blocks=2, block_size=4, batches=1, iters=1,
                   taps_dir=str(tmp_path / "taps"), modes=("disk",))
    assert (tmp_path / "taps" / "taps.bin").is_file()
