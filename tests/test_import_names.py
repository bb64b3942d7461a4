"""The repository's top-level kernels/ (installed as minillm.kernels) never shadows Hugging Face's
`kernels` package, which transformers (>= 5.25) imports at start, however Python or pytest is started
from the repository root (which puts the root on sys.path)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_from_root(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_python_from_the_root_imports_hugging_faces_kernels():
    done = _run_from_root("-c", "import kernels, transformers, minillm.kernels, sys\n"
                                "print(kernels.__file__, sys.modules['minillm.kernels'].__file__)")
    assert done.returncode == 0, done.stderr
    theirs, ours = map(Path, done.stdout.split())
    assert ours == ROOT / "kernels" / "__init__.py"
    assert ROOT / "kernels" not in theirs.parents  # Hugging Face's, from site-packages


def test_python_m_pytest_from_the_root_runs_transformers(tmp_path):
    test = tmp_path / "test_tiny.py"
    test.write_text("def test_transformers_imports():\n"
                    "    from transformers import AutoModelForCausalLM, LlamaConfig\n"
                    "    assert AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=16, intermediate_size=32,\n"
                    "        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64))\n")
    done = _run_from_root("-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(test))
    assert done.returncode == 0, done.stdout + done.stderr
