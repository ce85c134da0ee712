"""Our target against the PyTorch reference (transformers), layer by layer, on the same token ids.

Answers "where do JAX and PyTorch part ways, and is it a bug or a bf16 tie?": per-layer hidden
state errors name the first layer that leaves tolerance; greedy continuations on both sides name
the first position where they part and the top-2 margin of each side there.

The PyTorch side is imported lazily (`pip install 'dflash-jax[compare]'`); nothing here imports
torch at module load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ModelConfig
from dflash_jax.kv_cache import KVCache

# Relative error past which a layer is named as where the two sides part. Float32 agreement is
# ~1e-6 on the tiny tests and on SmolLM2; bf16 rounding alone reaches ~1e-2 after a few layers.
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}

INSTALL_HINT = ("pip install 'dflash-jax[compare]' (torch, transformers, accelerate); for drafters also "
                "pip install --no-deps dflash==0.1.0")


def require_reference(*modules: str) -> None:
    """Imports the PyTorch-side packages or raises one ValueError that says how to install them."""
    import importlib

    missing = []
    for name in modules or ("torch", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ValueError(f"the PyTorch reference needs {', '.join(missing)}: {INSTALL_HINT}")


def load_reference(source: str, dtype: str = "float32") -> Any:
    """The transformers model for `source` ('smollm2', a .gguf file or an HF directory), in eval mode.

    It is read by transformers itself, not from our params, so a conversion bug shows up.
    """
    from convert import is_qwen35, resolve_source

    kind, path = resolve_source(source)
    if kind == "checkpoint":
        raise ValueError(f"--model {source}: a converted dflash-jax checkpoint has no PyTorch counterpart; "
                         f"compare the HF directory or .gguf file it was converted from")
    if kind == "hf" and is_qwen35(path):
        raise ValueError(f"--model {source}: comparing Qwen3.5 / Qwen3.6 hybrids is not supported yet")
    require_reference("torch", "transformers", *(("accelerate", "gguf") if kind == "gguf" else ()))
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path if path.is_dir() else path.parent),
                                                     dtype=torch_dtype)
    return model.eval()


def our_forward(params: Any, cfg: ModelConfig, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """ids [T] -> (per-layer outputs [layers, T, embed], logits [T, vocab]) in float32.

    Layer i's output is HF's `hidden_states[i + 1]` (the last one after the final norm).
    """
    from dflash_jax.model import forward_jit

    t = len(ids)
    dtype = params.embed.dtype
    shape = (1, t, cfg.num_kv_heads, cfg.head_dim)
    cache = KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                    v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                    lengths=jnp.zeros((1,), jnp.int32))
    tokens = jnp.asarray([list(ids)], jnp.int32)
    out = forward_jit(params, cfg, tokens, jnp.arange(t, dtype=jnp.int32)[None], cache,
                      tap_layers=tuple(range(cfg.num_layers)))
    taps = np.asarray(out.taps.astype(jnp.float32))[0].reshape(t, cfg.num_layers, -1).transpose(1, 0, 2)
    return taps, np.asarray(out.logits.astype(jnp.float32))[0]


def reference_forward(model: Any, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The same as `our_forward` from the transformers model."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), output_hidden_states=True)
    hidden = np.stack([h[0].float().numpy() for h in out.hidden_states[1:]])
    return hidden, out.logits[0].float().numpy()


def _errors(ours: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """max |d|, ||d|| / ||ref|| and the cosine of two flattened arrays."""
    a, b = ours.reshape(-1).astype(np.float64), ref.reshape(-1).astype(np.float64)
    d = a - b
    nb = np.linalg.norm(b)
    return {"max_abs": float(np.abs(d).max()), "rel": float(np.linalg.norm(d) / max(nb, 1e-30)),
            "cosine": float(a @ b / max(np.linalg.norm(a) * nb, 1e-30))}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _margin(logits: np.ndarray) -> tuple[list[int], float]:
    """The top-2 tokens of one row and the logit gap between them."""
    top = np.argsort(-logits)[:2]
    return [int(t) for t in top], float(logits[top[0]] - logits[top[1]])


def _greedy_ours(params: Any, cfg: ModelConfig, ids: Sequence[int], n: int) -> list[int]:
    from dflash_jax import pipeline
    from dflash_jax.sampling import SamplingParams

    prompts, lens = pipeline.pad_prompts([list(ids)])
    run = pipeline.run_ar(params, cfg, prompts, lens, max_new_tokens=n, sampling=SamplingParams(0.0),
                          stop_tokens=())
    return run.token_lists()[0]


def _greedy_reference(model: Any, ids: Sequence[int], n: int) -> list[int]:
    import torch

    out, past, step = [], None, torch.tensor([list(ids)])
    with torch.no_grad():
        for _ in range(n):
            res = model(step, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].float().argmax())
            out.append(tok)
            step = torch.tensor([[tok]])
    return out


def compare_target(params: Any, cfg: ModelConfig, reference: Any, ids: Sequence[int], *, tokens: int = 32,
                   dtype: str = "float32") -> dict[str, Any]:
    """Compares our target with `reference` (a transformers causal LM) on prompt `ids` [T].

    -> {"layers": [{layer, max_abs, rel, cosine}], "first_bad_layer": int or None, "logits": {...},
        "greedy": {...}, "verdict": str}. A layer is bad when its relative error passes
    TOLERANCE[dtype]; the first bad one is where the two sides part.
    """
    if not ids:
        raise ValueError("compare: the prompt has no tokens")
    ours_h, ours_l = our_forward(params, cfg, ids)
    ref_h, ref_l = reference_forward(reference, ids)
    if ours_h.shape != ref_h.shape or ours_l.shape != ref_l.shape:
        raise ValueError(f"compare: shapes differ, ours hidden {ours_h.shape} logits {ours_l.shape} against "
                         f"reference {ref_h.shape} {ref_l.shape} (not the same model?)")
    tol = TOLERANCE[dtype]
    layers = [{"layer": i, **_errors(ours_h[i], ref_h[i])} for i in range(ours_h.shape[0])]
    first_bad = next((row["layer"] for row in layers if row["rel"] > tol), None)
    lp_ours, lp_ref = _log_softmax(ours_l), _log_softmax(ref_l)
    kl = (np.exp(lp_ref) * (lp_ref - lp_ours)).sum(-1)
    logit_err = float(np.abs(ours_l - ref_l).max())
    logits = {"top1_agreement": float((ours_l.argmax(-1) == ref_l.argmax(-1)).mean()), "max_abs": logit_err,
              "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}
    greedy = compare_greedy(params, cfg, reference, ids, tokens, logit_err)
    if first_bad is not None:
        verdict = (f"real disagreement: layer {first_bad} leaves tolerance (relative error "
                   f"{layers[first_bad]['rel']:.2e} > {tol:g})")
    else:
        verdict = greedy["verdict"]
    return {"dtype": dtype, "prompt_tokens": len(ids), "tolerance": tol, "layers": layers,
            "first_bad_layer": first_bad, "logits": logits, "greedy": greedy, "verdict": verdict}


def compare_greedy(params: Any, cfg: ModelConfig, reference: Any, ids: Sequence[int], n: int,
                   logit_err: float) -> dict[str, Any]:
    """Greedy continuations of `n` tokens on both sides and, where they part, each side's top-2 there.

    A parting is a near-tie when both sides rank the same two tokens first and second (in either
    order) and both top-2 gaps are within 4x the logits error seen on the prompt (`logit_err`):
    a gap that small is inside what the two sides' rounding can flip.
    """
    ours = _greedy_ours(params, cfg, ids, n)
    ref = _greedy_reference(reference, ids, n)
    part = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    out: dict[str, Any] = {"tokens": n, "ours": ours, "reference": ref, "first_difference": part}
    if part is None:
        out["verdict"] = f"agree: the greedy continuations of {n} tokens are identical"
        return out
    context = list(ids) + ours[:part]  # the same on both sides up to the parting
    top_o, gap_o = _margin(our_forward(params, cfg, context)[1][-1])
    top_r, gap_r = _margin(reference_forward(reference, context)[1][-1])
    out["at_difference"] = {"ours_top2": top_o, "ours_margin": gap_o, "reference_top2": top_r,
                            "reference_margin": gap_r}
    out["verdict"] = classify_parting(part, top_o, gap_o, top_r, gap_r, logit_err)
    return out


def classify_parting(part: int, top_o: list[int], gap_o: float, top_r: list[int], gap_r: float,
                     logit_err: float) -> str:
    """The verdict line for continuations that part at token `part` (see `compare_greedy`)."""
    if set(top_o) == set(top_r) and max(gap_o, gap_r) <= 4 * max(logit_err, 1e-6):
        return (f"near-tie: the continuations part at token {part}, where the top-2 gap is {gap_o:.3g} (ours) "
                f"and {gap_r:.3g} (reference), within 4x the logits error {logit_err:.3g}")
    return (f"real disagreement: the continuations part at token {part}, top-2 gap {gap_o:.3g} (ours) and "
            f"{gap_r:.3g} (reference), more than rounding (logits error {logit_err:.3g}) explains")


def load_reference_drafter(path: str, dtype: str = "float32") -> Any:
    """dflash 0.1.0's DFlashDraftModel for a drafter directory (or a shipped drafter's name)."""
    require_reference("torch", "transformers", "dflash")
    import torch
    from dflash.model import DFlashDraftModel

    from convert.shipped import DFLASH, resolve_shipped

    directory = resolve_shipped(path, DFLASH, "--draft")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return DFlashDraftModel.from_pretrained(str(directory), dtype=torch_dtype).eval()


def _context_taps(hidden: np.ndarray, layer_ids: Sequence[int]) -> np.ndarray:
    """Per-layer outputs [layers, T, embed] -> the drafter's context features [T, taps * embed]."""
    return np.concatenate([hidden[i] for i in layer_ids], -1)


def compare_drafter(params: Any, cfg: ModelConfig, dparams: Any, dcfg: Any, reference_target: Any,
                    reference_drafter: Any, ids: Sequence[int], *, dtype: str = "float32") -> dict[str, Any]:
    """One drafter pass on both sides: context = our target's tap features of ids[:-1] (the same
    array fed to both), root = ids[-1] at position len(ids) - 1.

    -> {"depths": [{depth, max_abs, rel, cosine, top1_agree}], "first_bad_depth": int or None}; a
    depth is bad when its logits' relative error passes TOLERANCE[dtype].
    """
    import torch
    from dflash import model as dm

    from dflash_jax.drafter import DraftCache, append_context, draft, draft_logits, make_block

    if len(ids) < 2:
        raise ValueError("compare: the drafter needs a prompt of at least 2 tokens (context and root)")
    n = len(ids) - 1
    taps = _context_taps(our_forward(params, cfg, ids[:-1])[0], dcfg.target_layer_ids).astype(np.float32)
    bs = dcfg.block_size
    cache = DraftCache.create(dcfg, batch=1, max_len=n + bs, dtype=params.embed.dtype)
    cache = append_context(dparams, dcfg, cache, jnp.asarray(taps[None], params.embed.dtype),
                           jnp.arange(n, dtype=jnp.int32)[None], jnp.asarray([n], jnp.int32))
    block = make_block(dcfg, jnp.asarray([ids[-1]], jnp.int32))
    hidden = draft(dparams, dcfg, params, cache, block, jnp.asarray([n], jnp.int32))
    ours = np.asarray(draft_logits(dparams, dcfg, params, hidden).astype(jnp.float32))[0]

    rd = reference_drafter
    with torch.no_grad():
        scale = float(dm._draft_value(rd.config, "input_embedding_scale", 1.0))
        noise = dm._raw_input_embeddings(reference_target, torch.tensor(np.asarray(block)), scale)
        ref_hidden = rd(target_hidden=torch.tensor(taps[None]).to(noise.dtype), noise_embedding=noise,
                        position_ids=torch.arange(n + bs)[None], past_key_values=dm._make_cache(rd.config),
                        use_cache=True)
        ref = rd.compute_logits(ref_hidden[:, 1:], dm._output_head(reference_target))[0].float().numpy()
    tol = TOLERANCE[dtype]
    depths = [{"depth": d + 1, **_errors(ours[d], ref[d]), "top1_agree": bool(ours[d].argmax() == ref[d].argmax())}
              for d in range(bs - 1)]
    first_bad = next((row["depth"] for row in depths if row["rel"] > tol), None)
    return {"depths": depths, "first_bad_depth": first_bad}


def format_table(report: dict[str, Any]) -> str:
    """The report as a terminal table: one row per layer, then logits, greedy and the verdict."""
    lines = [f"{'layer':>5}  {'max |d|':>10}  {'rel err':>10}  {'cosine':>10}"]
    for row in report["layers"]:
        mark = "  <- first past tolerance" if row["layer"] == report["first_bad_layer"] else ""
        lines.append(f"{row['layer']:>5}  {row['max_abs']:>10.3e}  {row['rel']:>10.3e}  {row['cosine']:>10.7f}{mark}")
    lg = report["logits"]
    lines.append(f"logits: top-1 agreement {lg['top1_agreement']:.3f}, max |d| {lg['max_abs']:.3e}, "
                 f"KL mean {lg['kl_mean']:.3e} max {lg['kl_max']:.3e}")
    g = report["greedy"]
    where = "no difference" if g["first_difference"] is None else f"first difference at token {g['first_difference']}"
    lines.append(f"greedy {g['tokens']} tokens: {where}")
    if "drafter" in report:
        dr = report["drafter"]
        lines.append(f"{'depth':>5}  {'max |d|':>10}  {'rel err':>10}  {'cosine':>10}  top-1 (drafter logits)")
        for row in dr["depths"]:
            mark = "  <- first past tolerance" if row["depth"] == dr["first_bad_depth"] else ""
            lines.append(f"{row['depth']:>5}  {row['max_abs']:>10.3e}  {row['rel']:>10.3e}  {row['cosine']:>10.7f}  "
                         f"{'same' if row['top1_agree'] else 'DIFFERS'}{mark}")
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


def plot_layers(report: dict[str, Any], path: str | Path) -> Path:
    """PNG of relative error and max |d| by layer (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["layer"] for r in report["layers"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.semilogy(xs, [max(r["rel"], 1e-12) for r in report["layers"]], "o-", label="relative error")
    ax.semilogy(xs, [max(r["max_abs"], 1e-12) for r in report["layers"]], "s--", label="max |d|")
    ax.axhline(report["tolerance"], color="gray", lw=0.8, label="tolerance (relative)")
    ax.set_xlabel("layer")
    ax.set_title(f"ours against the PyTorch reference ({report['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
