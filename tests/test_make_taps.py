"""`dflash-jax make-taps` loads the target straight in the taps' dtype (no float32 copy of a large
target beside its cast), writes the same taps as a float32 load cast to that dtype, and marks
them complete only when every row is written: `train --taps` refuses a store left halfway."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

import convert
from dflash_jax import train as tr
from dflash_jax.cli import main
from dflash_jax.train_data import TapStore, TokenData, build_sequences
from tests.spec_models import VOCAB, target_model


def test_make_taps_loads_the_target_in_the_taps_dtype(tmp_path, monkeypatch, capsys):
    target_model(vocab=VOCAB).save_pretrained(tmp_path / "target")
    data = TokenData.from_lists([[1, 2, 3]] * 3, [[4, 5, 6, 7, 8, 9]] * 3, [0.0] * 3, [0] * 3, {})
    tokens = data.save(tmp_path / "tokens.npz")
    loads = []
    real = convert.load_model

    def recording(*args, **kwargs):
        loads.append(jnp.dtype(kwargs["dtype"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(convert, "load_model", recording)
    assert main(["make-taps", "--target", str(tmp_path / "target"), "--data", str(tokens), "--out",
                 str(tmp_path / "taps"), "--seq-len", "16", "--layers", "1", "--batch", "2", "--dtype", "bfloat16",
                 "--no-progress"]) == 0, capsys.readouterr().err
    assert loads == [jnp.dtype(jnp.bfloat16)]
    made = TapStore.open(tmp_path / "taps")
    assert made.complete
    monkeypatch.undo()
    cfg, params, _ = real(tmp_path / "target", dtype=jnp.float32, tokenizer=False)
    seqs = build_sequences(TokenData.load(tokens), 16)
    ref = tr.write_taps(params, cfg, seqs, made.tap_layers, tmp_path / "ref", batch_size=2, dtype="bfloat16",
                        progress=False)
    rows = np.arange(made.rows)
    np.testing.assert_array_equal(made.read(rows).astype(np.float32), ref.read(rows).astype(np.float32))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == "bfloat16"


def test_train_refuses_taps_that_make_taps_did_not_finish(tmp_path, monkeypatch, capsys):
    """A store created and partly written (make-taps killed halfway) has the full file size, its
    missing rows zeros: train refuses it before loading anything."""
    store = TapStore.create(tmp_path / "taps", 4, 16, 8, "float32", (1,))
    store.write(0, np.ones((2, 16, 8), np.float32))
    assert not TapStore.open(tmp_path / "taps").complete

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before --taps was checked")

    monkeypatch.setattr(convert, "load_model", no_load)
    tokens = TokenData.from_lists([[1, 2]], [[3, 4, 5]], [0.0], [0], {}).save(tmp_path / "tokens.npz")
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(tokens), "--taps",
                 str(tmp_path / "taps")]) == 2
    err = capsys.readouterr().err
    assert "--taps" in err and "incomplete" in err and "Traceback" not in err, err
    store.mark_complete()
    assert TapStore.open(tmp_path / "taps").complete


def test_a_mesh_batch_reads_each_stored_taps_row_once(tmp_path):
    """Under a dp mesh `load_batch` reads each row's taps once (one read per dp shard), with no
    extra row read only to learn the batch's shapes: a row of a 27B target's taps is 100 MB."""
    from dflash_jax import sharding as sh

    data = TokenData.from_lists([[1, 2]] * 4, [[3, 4, 5, 6]] * 4, [0.0] * 4, [0] * 4, {})
    seqs = build_sequences(data, 8)
    store = TapStore.create(tmp_path / "taps", len(seqs), 8, 3, "float32", (0,))
    store.write(0, np.arange(4 * 8 * 3, dtype=np.float32).reshape(4, 8, 3))
    read = []
    real_read = store.read

    def counting(indices):
        read.extend(np.asarray(indices).tolist())
        return real_read(indices)

    store.read = counting
    tapped = tr.TappedSequences(seqs, store)
    batch = tr.load_batch(tapped, np.array([3, 1, 0, 2]), sh.make_mesh(2, 1))
    assert sorted(read) == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.asarray(batch["taps"]), real_read(np.array([3, 1, 0, 2])))
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), seqs.batch(np.array([3, 1, 0, 2]))["tokens"])

