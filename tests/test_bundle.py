"""The bundled models: present, small, loadable, and useful as a speculative pair."""
from __future__ import annotations

import os

import jax
import pytest

import jspec
from jspec import bundle


def _size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_bundle_is_complete_and_small():
    root = bundle.bundle_path()
    parts = ("target", "eagle3", "dflash", "standalone")
    for part in parts:
        assert os.path.isfile(os.path.join(root, part, "config.json"))
    assert sum(_size(os.path.join(root, part)) for part in parts) <= 48 * 2 ** 20
    p = bundle.load("eagle3", dtype="float32")
    assert p.config.num_params() <= 20_000_000 and isinstance(p.draft.config, jspec.Eagle3Draft)
    # The first run's speed-up rests on a head that is cheap beside its target: a draft step
    # reads about a tenth of the target's weights (docs/benchmarks.md, "The first run").
    head = sum(w.size for w in jax.tree.leaves(p.draft.weights["params"]))
    assert head <= 0.12 * p.config.num_params() and p.config.num_layers >= 16
    assert p.draft.config.draft_vocab_size < p.config.vocab_size and "d2t" in p.draft.weights
    d = bundle.load("dflash", dtype="float32").draft
    assert isinstance(d.config, jspec.DFlashDraft) and d.config.block_size == 16
    assert d.config.mask_token_id == p.tokenizer.pad_token_id  # never in the training text
    # Its own chat template, so chat-first clients run out of the box (served over HTTP with
    # a template given by --chat-template in tests/test_server.py).
    chat = p.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "add two numbers"}],
                                           tokenize=False, add_generation_prompt=True)
    assert "Be brief." in chat and "add two numbers" in chat and len(chat) > len("Be brief.add two numbers")


@pytest.mark.slow
def test_bundle_speculation_is_exact_and_accepts(capsys):
    """On code, the trained EAGLE-3 head and DFlash drafter accept well over one token per
    round, and the output equals plain greedy decoding (float32 on CPU); the first run
    times both."""
    p = bundle.load("eagle3", dtype="float32")
    d = bundle.load("dflash", dtype="float32")
    prompt = "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    kw = dict(max_new_tokens=48, stop_token_ids=[])
    plain = jspec.generate(p.with_draft(None), prompt, **kw)
    for params in (p, d):
        spec = jspec.generate(params, prompt, spec=jspec.SpecConfig(num_steps=4), **kw)
        assert spec.tokens == plain.tokens
        assert spec.stats.mean_accept_length > 1.5, (type(params.draft.config).__name__, spec.stats)
    # The first run, as the README gives it (the same request: its three programs are reused),
    # which times both bundled drafters and says which was faster.
    from jspec.__main__ import main
    assert main([prompt, "--max-new-tokens", "48", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "mean accepted length" in out and "tokens/s" in out and "outputs identical" in out
    assert "speculative (eagle3" in out and "speculative (dflash" in out and "the fastest here" in out
