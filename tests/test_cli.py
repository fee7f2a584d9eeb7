"""`python -m jspec`: bad input is a one-line usage error (exit status 2), `bench` prints its
table, and the text is streamed (`jspec.stream`). Runs `main(argv)` in-process
on the tiny 2-layer Llama with a random EAGLE-3 head; the bench and generate runs share
one plan per configuration, so the file compiles two loops."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest

import jax
import jspec
import tiny_models
from jspec.__main__ import main
from jspec.bench import BenchRow, format_table, parse_spec, read_prompts

PROMPT = "def f(x):"  # byte tokens: one prompt-length bucket with the bench prompts


@pytest.fixture(scope="module")
def pair(tmp_path_factory, llama_dir, target):
    """(target dir, EAGLE-3 draft dir) of the tiny Llama."""
    path = str(tmp_path_factory.mktemp("cli_eagle3"))
    tiny_models.make_random_draft(path, "eagle3", target, seed=7)
    return llama_dir[0], path


def _usage_error(capsys, argv, *needles):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err  # one line
    assert err.startswith(("python -m jspec: error: ", "python -m jspec bench: error: ")), err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("argv, needles", [
    (["--steps", "0"], ["--steps", ">= 1"]),
    (["--topk", "-1"], ["--topk"]),
    (["--tokens", "1"], ["--tokens"]),
    (["--steps", "two"], ["--steps", "integer"]),
    (["--dtype", "float64"], ["--dtype", "float64"]),
    (["--max-new-tokens", "-5"], ["--max-new-tokens"]),
    (["--temperature", "-0.5"], ["--temperature"]),
    (["--temperature", "nan"], ["--temperature"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--top-p", "1.5"], ["--top-p"]),
    (["--top-k", "-2"], ["--top-k"]),
    (["--seed", "-1"], ["--seed"]),
    (["--target", "/no/such/dir"], ["--target", "/no/such/dir"]),
    (["--draft", "/no/such/draft"], ["--draft"]),
    (["--steps", "4", "--tokens", "9"], ["num_draft_tokens"]),  # SpecConfig's own check
    (["--no-such-flag"], ["--no-such-flag"]),
    (["bench", "--batch", "0"], ["--batch"]),
    (["bench", "--spec", "3,2,40"], ["--spec", "num_draft_tokens"]),
    (["bench", "--spec", "a,b"], ["--spec"]),
    (["bench", "--repeats", "0"], ["--repeats"]),
    (["bench", "--prompts", "/no/such/file"], ["--prompts"]),
    (["bench", "--draft", "none"], ["--draft"]),
])
def test_bad_flags_are_one_line_usage_errors(capsys, argv, needles):
    _usage_error(capsys, argv, *needles)


def test_bad_directories_and_refused_input(capsys, tmp_path, pair):
    t, d = pair
    _usage_error(capsys, ["--target", str(tmp_path)], "config.json")  # not a model directory
    _usage_error(capsys, ["--target", t, "--draft", str(tmp_path)], "config.json")
    _usage_error(capsys, ["--target", t, "--draft", "eagle3"], "bundled")
    _usage_error(capsys, ["bench", "--target", t], "--draft")
    # refused by jspec.compile's own checks (before anything compiles)
    _usage_error(capsys, ["", "--target", t, "--draft", d], "empty")
    (tmp_path / "empty.txt").write_text("\n\n")
    _usage_error(capsys, ["bench", "--prompts", str(tmp_path / "empty.txt")], "no prompts")
    _usage_error(capsys, [PROMPT, "--target", t, "--draft", "ngram", "--temperature", "0.5", "--sample-drafts"],
                 "sample_drafts", "n-gram drafts have none")


def test_bench_prints_table(capsys, tmp_path, pair):
    t, d = pair
    f = tmp_path / "prompts.txt"
    f.write_text(f'{PROMPT}\n\n"x = 1\\ny ="\n')
    assert read_prompts(str(f)) == [PROMPT, "x = 1\ny ="]
    assert main(["bench", "--target", t, "--draft", d, "--spec", "2,1,3", "--prompts", str(f),
                 "--max-new-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "2 prompts" in out[0] and "8 new tokens" in out[0]
    head = [c.strip() for c in out[1].strip("|").split("|")]
    assert head == ["batch", "decoding", "S,K,N", "tau", "tokens/s", "speed-up", "ms/round", "same output",
                    "compile s"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out[3:]]
    assert [r[:3] for r in rows] == [["1", "plain", "-"], ["1", "chain", "2,1,3"]]
    plain, chain = rows
    assert plain[3] == "1.00" and plain[5] == "1.00x"
    assert 1.0 <= float(chain[3]) <= 3.0 and float(chain[4]) > 0
    assert chain[7] == "100%"  # float32: speculative output == plain decoding's
    # ms a round: a row's tau tokens a round at the run's tokens/s
    assert float(chain[6]) == pytest.approx(1000 * float(chain[3]) / float(chain[4]), rel=0.02)


def test_bench_with_ngram_drafts(capsys, pair):
    """`--draft ngram` with any target: prompt lookup, benchmarked against plain decoding."""
    t, _ = pair
    assert main(["bench", "--target", t, "--draft", "ngram", "--spec", "2,1,3", "--max-new-tokens", "8",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith(f"target {t}, draft ngram, float32")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out[3:]]
    assert [r[:3] for r in rows] == [["1", "plain", "-"], ["1", "chain", "2,1,3"]]
    assert rows[1][7] == "100%"  # speculative output == plain decoding's


def test_generate_prints_text_and_stats(capsys, monkeypatch, pair):
    t, d = pair
    argv = [PROMPT, "--target", t, "--draft", d, "--steps", "2", "--max-new-tokens", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    streamed = out.split("\n" + "-" * 72)[0]
    want = jspec.generate(jspec.load(t, draft=d), PROMPT, max_new_tokens=8, stop_token_ids=[],
                          spec=jspec.SpecConfig(num_steps=2))
    assert streamed == PROMPT + want.text
    assert "mean accepted length" in out and "outputs identical" in out
    assert "medians of 5 timed runs" in out

    seen = {}

    def fake_stream(params, prompt, **kw):  # the interface the CLI expects of jspec.stream
        seen.update(kw, prompt=prompt)
        yield types.SimpleNamespace(text="<one>", tokens=[1])
        yield types.SimpleNamespace(text="<two>", tokens=[2])

    monkeypatch.setattr(jspec, "stream", fake_stream, raising=False)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT + "<one><two>\n")
    assert seen["prompt"] == PROMPT and seen["spec"] == jspec.SpecConfig(num_steps=2) and seen["max_new_tokens"] == 8
    assert "mean accepted length" in out

    # Without --steps the chain has the device's default length: 2 on a CPU.
    assert main([a for a in argv if a not in ("--steps", "2")]) == 0
    assert "S=2, K=1, N=3" in capsys.readouterr().out
    from jspec.__main__ import default_steps, first_run_trees
    assert first_run_trees() == []  # a CPU times the chain and the DFlash block only
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert default_steps() == 5
    assert first_run_trees() == [jspec.SpecConfig(num_steps=8, topk=2, num_draft_tokens=16)]


def test_parse_spec_and_format_table():
    assert parse_spec("5,8,16") == jspec.SpecConfig(num_steps=5, topk=8, num_draft_tokens=16)
    assert parse_spec("3") == jspec.SpecConfig(num_steps=3)
    budgeted = parse_spec("15/3:1,7:1.1,15:1.25")
    assert budgeted == jspec.SpecConfig(num_steps=15, verify_lengths=(3, 7), verify_costs=(1.0, 1.1, 1.25))
    assert parse_spec("15/3:1,15:2^0.5") == jspec.SpecConfig(15, verify_lengths=(3,), verify_costs=(1, 2),
                                                             survival_power=0.5)
    by_rows = parse_spec("15/3:0.6,15:0.62@1+3:1.1,15:1.6@16")
    assert by_rows == jspec.SpecConfig(15, verify_lengths=(3,), verify_costs=((0.6, 0.62), (1.1, 1.6)),
                                       verify_cost_rows=(1, 16))
    for bad in ("", "1,2,3,4", "x", "15/3:1,7:1.1", "15/3:1,15", "15/3:x,15:1", "15/15:1,15:2", "15/3:1,15:2^0",
                "15/3:1,15:2^x", "15/3:1,15:2@1+3:1,15:2", "15/3:1,15:2@1+7:1,15:2@4", "15/3:1,15:2@4+3:1,15:2@2"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    rows = [BenchRow(4, None, 1.0, 100.0, 1.0, 1.0, 2.0, (100.0,)),
            BenchRow(4, parse_spec("5,8,16"), 3.5, 250.0, 2.5, 0.75, 3.0, (250.0,)),
            BenchRow(4, parse_spec("15/3:1,7:1.1,15:1.25^0.5"), 4.0, 400.0, 4.0, 1.0, 3.0, (400.0,)),
            BenchRow(4, by_rows, 4.0, 400.0, 4.0, 1.0, 3.0, (400.0,))]
    lines = format_table(rows).splitlines()
    assert len(lines) == 6 and len({len(line) for line in lines}) == 1  # aligned
    assert "| tree " in lines[3] and "5,8,16" in lines[3] and "2.50x" in lines[3] and "75%" in lines[3]
    assert " 56.00 |" in lines[3]  # ms a round: 3.5 tokens a row a round, 4 rows, 250 tokens/s
    assert "15,1,16/3:1,7:1.1,15:1.25^0.5" in lines[4]
    assert "15,1,16/3:0.6,15:0.62@1+3:1.1,15:1.6@16 " in lines[5]


def test_loading_prints_no_warnings_without_pytorch():
    """jspec needs no PyTorch: loading the bundle (its tokenizer imports transformers) on a
    machine without it prints nothing; transformers' advice about it would go to stderr."""
    code = ("import importlib.util\n"
            "find = importlib.util.find_spec\n"  # as if torch were not installed
            "importlib.util.find_spec = lambda n, *a: None if n.split('.')[0] == 'torch' else find(n, *a)\n"
            "from jspec import bundle\n"
            "assert bundle.load('eagle3').tokenizer is not None\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_compilation_cache_directory(monkeypatch, tmp_path):
    """`--compilation-cache`: a directory turns JAX's persistent cache on there; without the
    flag $JAX_COMPILATION_CACHE_DIR (which JAX reads itself) or ~/.cache/jspec/xla; 'none'
    leaves it off."""
    from jspec.__main__ import compilation_cache
    set_to = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: set_to.append((name, value)))
    assert compilation_cache(str(tmp_path)) == str(tmp_path)
    assert compilation_cache("none") is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    assert compilation_cache(None) == "/somewhere"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache(None) == str(tmp_path / "xdg" / "jspec" / "xla")
    assert set_to == [("jax_compilation_cache_dir", str(tmp_path)),
                      ("jax_compilation_cache_dir", str(tmp_path / "xdg" / "jspec" / "xla"))]
