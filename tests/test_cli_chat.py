"""The ``minillm`` command at its edges: ``chat --message`` for one turn or several, bad arguments and
missing prompts reported before the model loads, Ctrl-C as one line and status 130."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

import minillm
import minillm.engine
from minillm import LLM, SamplingParams
from minillm.cli import main


def model_args(path) -> list[str]:
    return ["--model", str(path), "--dtype", "float32", "--device", "cpu", "--max-tokens", "5"]


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model is an error: the command must fail before it."""
    monkeypatch.setattr(minillm.engine, "load_model", lambda *a, **k: pytest.fail("the model loaded"))


@pytest.mark.parametrize("system, turns", [(None, ["Hi"]), ("Be brief.", ["Name a color.", "And another one?"])])
def test_chat_message_runs_each_turn_with_the_history(tiny_text_model_dir, capsys, system, turns):
    main(["chat", *model_args(tiny_text_model_dir), *(["--system", system] if system else []),
          *[arg for turn in turns for arg in ("--message", turn)]])
    out = capsys.readouterr().out
    llm = LLM(str(tiny_text_model_dir), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=5, temperature=0)
    history, expected = [{"role": "system", "content": system}] if system else [], ""
    for turn in turns:
        history.append({"role": "user", "content": turn})
        reply = llm.chat(history, params)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        expected += f"assistant> {reply}\n"
    assert out == expected


@pytest.mark.parametrize("stdin", [io.StringIO(""), io.StringIO("\n  \n")])
def test_generate_without_a_prompt_says_so_before_loading(no_model, monkeypatch, stdin):
    monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(SystemExit, match="no prompt given"):
        main(["generate", "--model", "tiny", "--load-format", "dummy"])


def test_generate_at_a_terminal_without_a_prompt_does_not_wait_for_input(no_model, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

        def __iter__(self):
            raise AssertionError("read the terminal, waiting for input nobody was asked for")
    monkeypatch.setattr(sys, "stdin", Terminal())
    with pytest.raises(SystemExit, match="pass prompts as arguments"):
        main(["generate", "--model", "tiny", "--load-format", "dummy"])


@pytest.mark.parametrize("argv, named", [
    (["generate", "Hi", "--temperature", "nan"], "temperature"),
    (["generate", "Hi", "--max-tokens", "0"], "max_tokens"),
    (["chat", "--top-p", "2"], "top_p"), (["chat", "--sample-seed", str(2**64)], "seed"),
    (["generate", "Hi", "--max-num-seqs", "0"], "max_num_seqs"), (["chat", "--seed", str(-2**63 - 1)], "seed"),
    (["generate", "Hi", "--stop", ""], "stop"),
])
def test_bad_arguments_are_reported_before_the_model_loads(no_model, argv, named):
    with pytest.raises(SystemExit, match=f"minillm: error: {named}"):
        main([*argv, "--model", "tiny", "--load-format", "dummy"])


def test_ctrl_c_in_chat_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(prompt=""):
        raise KeyboardInterrupt
    monkeypatch.setattr("builtins.input", interrupted)
    try:
        main(["chat", "--model", "tiny", "--load-format", "dummy", "--device", "cpu"])
    except KeyboardInterrupt:  # caught here, or it would stop the test session
        pytest.fail("Ctrl-C escaped from main() as a KeyboardInterrupt, which Python prints as a traceback")
    except SystemExit as exit_:
        assert exit_.code == 130
    else:
        pytest.fail("main() returned after Ctrl-C")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-1] == "minillm: interrupted" and not any("Traceback" in line for line in lines)


def test_sigint_ends_the_chat_command_with_130_and_no_traceback():
    """A real Ctrl-C: SIGINT to the running command while it waits for the user's turn."""
    root = os.path.dirname(os.path.dirname(minillm.__file__))
    process = subprocess.Popen([sys.executable, "-m", "minillm.cli", "chat", "--model", "tiny", "--load-format",
                                "dummy", "--device", "cpu"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=root,
                               # (a pytest-xdist worker ignores SIGINT, and a child inherits that; Python then
                               # installs no KeyboardInterrupt handler: the child starts with the default)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        banner = process.stderr.readline()  # printed once the model is loaded, just before input()
        assert "minillm chat" in banner, banner
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip()] == ["minillm: interrupted"]
