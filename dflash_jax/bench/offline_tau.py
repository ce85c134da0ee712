"""The trainer's τ estimate on evaluation prompts, per drafter, without decoding with the drafter.

    python -m dflash_jax.bench.offline_tau --model smollm2 --prompts gsm8k/test.jsonl --limit 32 \\
        --draft dflash_jax/drafters/smollm2-135m-instruct-b16 OTHER_DRAFTER_DIR

The target answers the prompts greedily (worded as `bench` words them), and each drafter is
scored on those answers with the validation metrics of training (`train.evaluate`: random
anchors, τ estimate = 1 + leading correct block positions). Only scoring: nothing trains on
these prompts. It shows whether the estimate that `train --keep-best` ranks drafters by agrees
with the τ that decoding realises (`dflash-jax bench`). Expect it to read higher: anchors are
uniform over positions, while decoding's rounds skip quickly over the easy stretches.
"""
from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from dflash_jax import train as tr
from dflash_jax import train_data as td
from dflash_jax.bench.common import write_json
from dflash_jax.evaluate import load_bench_prompts
from dflash_jax.pipeline import encode_prompts, stop_tokens_for


def main(argv: list[str] | None = None) -> None:
    from convert import load_model
    from convert.dflash_drafter import load_drafter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", required=True, help="a JSONL prompt file, as for `dflash-jax bench`")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--draft", nargs="+", required=True, help="drafter directories")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3, help="anchor draws per drafter")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    cfg, params, tok = load_model(args.model, dtype=dtype)
    texts = [p.text for p in load_bench_prompts(args.prompts, limit=args.limit)]
    prompts = encode_prompts(tok, texts)
    n = len(prompts)
    responses, temps = td.generate_responses(params, cfg, prompts, max_new_tokens=args.max_new_tokens,
                                             batch_size=n, sample_fraction=0.0, stop_tokens=stop_tokens_for(tok, cfg),
                                             progress=False)
    data = td.TokenData.from_lists(prompts, responses, temps, [0] * n, {}, prompt_id=list(range(n)))
    seq_len = int(-(-max(len(p) + len(r) for p, r in zip(prompts, responses)) // 64) * 64)
    seqs = td.build_sequences(data, seq_len)
    out = {"prompts": args.prompts, "limit": n, "dtype": args.dtype, "drafters": {}}
    for d in args.draft:
        dcfg, dparams = load_drafter(d, dtype=dtype)
        taus, acc1 = [], []
        for seed in range(args.seeds):
            tc = tr.TrainConfig(steps=1, batch_size=8, seq_len=seq_len, num_blocks=32, seed=seed,
                                compute_dtype=args.dtype)
            vset = tr.validation_set(seqs, np.arange(n), tc, max_batches=-(-n // tc.batch_size))
            m = tr.evaluate(dparams, params, vset, cfg=cfg, dcfg=dcfg, tc=tc)
            taus.append(m["val_tau_estimate"])
            acc1.append(m["val_acc_by_pos"][0])
        out["drafters"][d] = {"tau_estimate": float(np.mean(taus)), "tau_estimate_per_seed": taus,
                              "acc_pos1": float(np.mean(acc1))}
        print(d, json.dumps(out["drafters"][d]), flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
