"""`make demo`'s path runs without torch, and `generate` shows its progress on stderr only.

Each command runs in a subprocess where torch is made unimportable the way a machine without it
behaves: `sys.modules["torch"] = None` (so `import torch` raises ModuleNotFoundError and
`importlib.util.find_spec("torch")`, which transformers uses to decide whether torch is there,
returns None) and a `sys.meta_path` finder that refuses torch and its submodules. A module of
torch that is loaded anyway fails the run.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_TORCH = r"""
import runpy, sys

class _RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r} (torch is blocked)", name=name)
        return None

sys.modules["torch"] = None
sys.meta_path.insert(0, _RefuseTorch())
code = 0
try:
    if sys.argv[1] == "-c":
        exec(compile(sys.argv[2], "<blocked>", "exec"))
    else:
        sys.argv = sys.argv[1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code
loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == "torch" and mod is not None)
if loaded:
    print(f"torch modules were loaded: {loaded}", file=sys.stderr)
    code = 3
sys.exit(code)
"""

PROMPT = "Natalia sold clips to 48 of her friends in April. How many is that?"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}


def without_torch(*argv: str, tty_stderr: bool = False, timeout: int = 600) -> tuple[int, str, str]:
    """Runs `python -m ARGV...` (or `-c CODE`) with torch blocked -> (exit code, stdout, stderr).

    tty_stderr: stderr is a pseudo-terminal, as in an interactive shell (progress is shown there).
    """
    cmd = [sys.executable, "-c", WITHOUT_TORCH, *argv]
    if not tty_stderr:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    parent, child = pty.openpty()
    # A new pseudo-terminal is 0 columns wide; tqdm would cut its line to nothing.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(parent, 4096)
            except OSError:  # the child's end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=child, text=True,
                           timeout=timeout)
    finally:
        os.close(child)
    reader.join(timeout=10)
    os.close(parent)
    return p.returncode, p.stdout, b"".join(chunks).decode(errors="replace")


# ----------------------------------------------------------------------------- the blocker works

def test_the_blocker_makes_torch_unimportable():
    code, out, err = without_torch("-c", "import torch")
    assert code != 0 and "ModuleNotFoundError" in err and "torch" in err
    code, out, err = without_torch("-c", "import torch.nn")
    assert code != 0 and "ModuleNotFoundError" in err
    code, out, err = without_torch("-c", "from transformers.utils import is_torch_available; "
                                         "print(is_torch_available())")
    assert code == 0, err
    assert out.strip() == "False"  # transformers takes the paths it takes where torch is absent


def test_the_blocker_catches_the_transformers_gguf_tokenizer():
    # What `make demo` used before: transformers' GGUF tokenizer imports torch.
    code, _, err = without_torch("-c", "from convert.gguf_file import smollm2_gguf_path\n"
                                       "from transformers import AutoTokenizer\n"
                                       "p = smollm2_gguf_path()\n"
                                       "AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)")
    assert code != 0 and "torch" in err


# ----------------------------------------------------------------------------- the demo's path

@pytest.fixture(scope="module")
def demo_run():
    """`generate` as `make demo` runs it (fewer tokens), torch blocked, stderr a terminal."""
    code, out, err = without_torch("dflash_jax.cli", "generate", "--model", "smollm2", "--method", "ddtree",
                                   "--draft", "smollm2", "--budget", "8", "--compare-ar", "--max-new-tokens", "12",
                                   PROMPT, "Hi!", tty_stderr=True)
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    return out, err


def test_demo_answers_without_torch(demo_run):
    out, _ = demo_run
    answers = re.findall(r"^>>> (.*)\n(.*)\n", out, re.M)
    assert [a[0] for a in answers] == [PROMPT, "Hi!"]
    assert all(a[1].strip() for a in answers)
    ddtree = re.search(r"^ddtree: (\d+) tokens in [\d.]+ s = ([\d.]+) tokens/s, tau ([\d.]+)", out, re.M)
    ar = re.search(r"^ar: +(\d+) tokens in [\d.]+ s = ([\d.]+) tokens/s", out, re.M)
    speedup = re.search(r"^ddtree is ([\d.]+)x as fast as ar; (.*)$", out, re.M)
    assert ddtree and ar and speedup, out
    assert ddtree.group(1) == ar.group(1)  # greedy: both commit the same number of tokens
    assert 1.0 <= float(ddtree.group(3)) <= 9.0  # at least the bonus token, at most the block
    assert speedup.group(2) == "the same tokens as ar (lossless)"


def test_progress_goes_to_stderr_only(demo_run):
    out, err = demo_run
    for stage in ("loading smollm2", "loading drafter smollm2", "compiling ddtree", "decoding ddtree",
                  "compiling ar", "decoding ar"):
        assert stage in err, err
        assert stage not in out
    assert "stages done" in err and "stages done" not in out


def test_quiet_and_json_print_no_progress():
    code, out, err = without_torch("dflash_jax.cli", "generate", "--model", "smollm2", "--max-new-tokens", "4",
                                   "--quiet", "--json", "Hi!", tty_stderr=True)
    assert code == 0, err
    record = json.loads(out)  # stdout is the record alone
    assert record["method"] == "ar" and record["tokens"] >= 1
    assert "stages done" not in err and "loading" not in err


def test_tokenizer_save_and_reload_without_torch(tmp_path):
    # convert's checkpoints keep the tokenizer beside the params; an HF directory carries its own.
    code, out, err = without_torch("-c", f"""
from pathlib import Path
from convert.checkpoint import load_checkpoint_tokenizer
from convert.gguf_file import gguf_tokenizer, smollm2_gguf_path
tok = gguf_tokenizer(smollm2_gguf_path())
tok.save_pretrained({str(tmp_path / "tokenizer")!r})
back = load_checkpoint_tokenizer(Path({str(tmp_path)!r}))
text = "Natalia sold  48 clips<|im_end|>"
print(back(text)["input_ids"] == tok(text)["input_ids"], back.eos_token)
""")
    assert code == 0, err
    assert out.split() == ["True", "<|im_end|>"]


def test_ar_verdict_says_what_a_difference_means():
    import jax.numpy as jnp
    from dflash_jax.cli import ar_verdict

    assert ar_verdict(True, 0.0, jnp.bfloat16) == "the same tokens as ar (lossless)"
    assert ar_verdict(False, 0.7, jnp.float32) == "tokens DIFFER from ar (sampling)"
    # Greedy in float32 must match exactly: a difference there is reported bare, never excused.
    assert ar_verdict(False, 0.0, jnp.float32) == "tokens DIFFER from ar"
    narrow = ar_verdict(False, 0.0, jnp.bfloat16)
    assert narrow.startswith("tokens DIFFER from ar: in bfloat16") and "--dtype float32" in narrow
