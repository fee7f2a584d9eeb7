"""Training: loss goes down, training-time-test shapes, export/load round trips, errors."""
from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
import tiny_models
from jspec.cache.layout import prefill_meta
from jspec.drafts import Eagle3Draft
from jspec.loading import load_draft
from jspec.train import Eagle3TrainConfig, train_eagle3, train_lm, ttt_logits
from jspec.train import common
from jspec.train import data as data_mod
from jspec.train.cli import main as cli_main
from jspec.train.eagle3 import draft_vocab, head_config, init_head
from jspec.export import save_target
from jspec.models import family_for

AUX = (1, 2, 2)  # the features of target layers 1, 2, 2 (the shared tiny Llama has two layers)

pytestmark = pytest.mark.slow  # training runs: CI runs them, the fast subset leaves them out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny synthetic corpus: a repeating grammar that a head can learn quickly."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.RandomState(0)
    words = ["def", "return", "self", "(", ")", ":", "x", "=", "1", "\n"]
    for i in range(4):
        (d / f"f{i}.py").write_text(" ".join(words[j % 10] for j in range(rng.randint(200, 400))))
    with open(d / "more.jsonl", "w") as f:
        for _ in range(3):
            f.write(json.dumps({"text": "def f(x): return x + 1\n" * 5}) + "\n")
    return str(d)


def test_ttt_unroll_shapes(target, monkeypatch):
    cfg = Eagle3TrainConfig(ttt_steps=3, draft_vocab_size=50, compute_dtype="float32")
    d = head_config(target, cfg, aux_layers=AUX)
    d2t = draft_vocab(np.arange(300)[::-1].astype(np.int64), 50)
    params = init_head(target, d, d2t, 0)
    B, T = 2, 12
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 300, (B, T)), jnp.int32)
    feats = jnp.zeros((B, T, 3 * target.config.hidden_size))
    out = jax.jit(lambda p, tw: ttt_logits(p, d, jnp.asarray(d2t), tw, target.config, tokens, feats, 3,
                                           jnp.float32))(params, target.weights)
    assert len(out) == 3
    chex.assert_shape(out, [(B, T, 50)] * 3)
    chex.assert_tree_all_finite(out)
    # Draft vocabulary = the 50 most frequent ids (here the lowest ids), mapped by d2t.
    assert (np.arange(50) + d2t).tolist() == list(range(50))
    # Gradients flow even where inference would pick the Pallas kernel (it has none).
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    from jspec.train import ttt_loss
    grads = jax.jit(jax.grad(lambda p, tw: ttt_loss(p, d, jnp.asarray(d2t), tw, target.config, tokens, 2)[0]))(
        params, target.weights)
    chex.assert_tree_all_finite(grads)
    assert float(jnp.abs(grads["midlayer"]["self_attn"]["qkv_proj"]["kernel"]).sum()) > 0


def test_ttt_differentiates_over_many_cache_slots(target):
    """Over more cache slots than the reference attends at once (1,024: it then runs an
    online softmax over blocks of them; 3 steps of 350 tokens fill 1,050), the TTT loss
    has gradients (its meta's `differentiable`: the loops' bounds static), as the
    bundle's recipe (5 steps of 512 tokens) needs on a GPU."""
    from jspec.kernels.attention.decode import REFERENCE_BLOCK_K
    from jspec.train import ttt_loss
    cfg = Eagle3TrainConfig(ttt_steps=3, draft_vocab_size=50, compute_dtype="float32")
    d = head_config(target, cfg, aux_layers=AUX)
    d2t = draft_vocab(np.arange(300)[::-1].astype(np.int64), 50)
    params = init_head(target, d, d2t, 0)
    T = 350
    assert 3 * T > REFERENCE_BLOCK_K
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 300, (1, T)), jnp.int32)
    grads = jax.jit(jax.grad(lambda p, tw: ttt_loss(p, d, jnp.asarray(d2t), tw, target.config, tokens, 3)[0]))(
        params, target.weights)
    chex.assert_tree_all_finite(grads)
    assert float(jnp.abs(grads["midlayer"]["self_attn"]["qkv_proj"]["kernel"]).sum()) > 0


def test_ttt_step0_equals_inference_extend(target, with_draft):
    """Training step 0 computes exactly what the inference draft-extend computes."""
    p = with_draft("eagle3")
    d, dw, tw, tc = p.draft.config, p.draft.weights, target.weights, target.config
    tokens = jnp.asarray(np.random.RandomState(1).randint(3, 300, (1, 10)), jnp.int32)
    meta = prefill_meta(jnp.array([10]), 10)
    hidden, aux, _ = family_for(tc).forward(tc, tw, tokens, None, meta, d.target_layers)
    feats = d.target_features(hidden, aux)
    got = ttt_logits(dw["params"], d, jnp.zeros((300,), jnp.int32), tw, tc, tokens, feats, 1, jnp.float32)[0]
    h, _ = d.forward(tc, tw, dw, jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))), feats, None, meta, True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(d.logits(tc, tw, dw, h)), atol=1e-4)


def _full_draft_logits(target, draft, seed: int = 2):
    """Target-vocabulary logits of draft step 0 (token i+1 with the target's feature at i),
    through the draft's own config (aux layers) and weights, for random tokens."""
    d, dw, tw, tc = draft.config, draft.weights, target.weights, target.config
    B, T = 2, 12
    tokens = jnp.asarray(np.random.RandomState(seed).randint(3, tc.vocab_size, (B, T)), jnp.int32)
    meta = prefill_meta(jnp.full((B,), T, jnp.int32), T)
    hidden, aux, _ = family_for(tc).forward(tc, tw, tokens, None, meta, d.target_layers)
    feats = d.target_features(hidden, aux)
    h, _ = d.forward(tc, tw, dw, jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))), feats, None, meta, True)
    return np.asarray(d.logits(tc, tw, dw, h), np.float32)


def test_eagle3_training_lowers_loss_exports_and_resumes(target, llama_dir, corpus, tmp_path):
    out = str(tmp_path / "head")
    cfg = Eagle3TrainConfig(steps=24, batch_size=4, seq_len=24, ttt_steps=2, draft_vocab_size=64, lr=1e-2,
                            warmup=2, compute_dtype="float32", checkpoint_every=12)
    draft, hist = train_eagle3(target, corpus, out, cfg, aux_layers=AUX, progress=False, log_every=1)
    losses = [h["loss"] for h in hist]
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    assert set(hist[-1]) >= {"loss", "acc0", "acc1"}
    cfg_json = json.load(open(os.path.join(out, "config.json")))
    assert cfg_json["architectures"] == ["LlamaForCausalLMEagle3"] and cfg_json["draft_vocab_size"] == 64
    assert cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    # Export then load: the same draft logits.
    p = target.with_draft(load_draft(out, target))
    assert isinstance(p.draft.config, Eagle3Draft) and p.draft.config.aux_layers == AUX
    from jspec import safetensors_io
    t = safetensors_io.load(os.path.join(out, "model.safetensors"))
    assert t["t2d"].dtype == np.bool_ and t["t2d"].sum() == 64 and t["d2t"].shape == (64,)
    # The whole draft forward (fc over the target's features, midlayer, norm, LM head) and
    # its d2t mapping, not only the LM head: every exported tensor is on the path.
    a, b = (_full_draft_logits(target, dp) for dp in (draft, p.draft))
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert np.abs(a).max() > 1
    np.testing.assert_array_equal(np.asarray(draft.weights["d2t"]), np.asarray(p.draft.weights["d2t"]))
    # Resume: a longer run picks up at the checkpoint instead of starting over.
    cfg2 = Eagle3TrainConfig(**{**cfg.__dict__, "steps": 30})
    _, hist2 = train_eagle3(target, corpus, out, cfg2, aux_layers=AUX, progress=False, log_every=1)
    assert hist2[0]["step"] == 25 and hist2[-1]["step"] == 30
    # A checkpoint for other settings is refused.
    cfg3 = Eagle3TrainConfig(**{**cfg.__dict__, "steps": 40, "draft_vocab_size": 32})
    with pytest.raises(ValueError, match="checkpoint .* was made with"):
        train_eagle3(target, corpus, out, cfg3, aux_layers=AUX, progress=False)


def test_eagle3_bfloat16_compute_keeps_float32_master_weights(target, corpus, tmp_path, monkeypatch):
    seen = set()
    real = Eagle3Draft.forward

    def spy(d, tc, tw, dw, tokens, hidden, *a, **k):  # runs at trace time
        seen.add((d.model.dtype, hidden.dtype.name, dw["params"]["fc"]["kernel"].dtype.name))
        return real(d, tc, tw, dw, tokens, hidden, *a, **k)

    monkeypatch.setattr(Eagle3Draft, "forward", spy)
    out = str(tmp_path / "bf16")
    cfg = Eagle3TrainConfig(steps=16, batch_size=4, seq_len=24, ttt_steps=2, draft_vocab_size=64, lr=1e-2,
                            warmup=2, compute_dtype="bfloat16")
    draft, hist = train_eagle3(target, corpus, out, cfg, aux_layers=AUX, progress=False, log_every=1)
    assert seen == {("bfloat16", "bfloat16", "bfloat16")}  # the head's forward pass runs in bfloat16
    losses = [h["loss"] for h in hist]
    assert np.all(np.isfinite(losses)) and np.mean(losses[-4:]) < losses[0] - 0.5, losses
    # Master weights (the checkpoint, what the optimiser updates) stay float32, and so do
    # the exported weights of a float32 target.
    from flax import serialization
    with open(os.path.join(out, "checkpoint", common.CKPT), "rb") as f:
        state = serialization.msgpack_restore(f.read())
    masters = jax.tree.leaves(state["params"])
    assert masters and all(np.asarray(x).dtype == np.float32 for x in masters)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(draft.weights["params"]))
    assert np.isfinite(_full_draft_logits(target, draft)).all()


def test_eagle3_resume_is_exact(target, corpus, tmp_path, monkeypatch):
    """N steps with an interruption after the checkpoint at N/2, then a resume, give the
    weights (and per-step losses) of N uninterrupted steps: the batch of step s depends only
    on (seed, s) and the checkpoint holds the optimiser state, schedule count included."""
    cfg = Eagle3TrainConfig(steps=6, batch_size=2, seq_len=12, ttt_steps=2, draft_vocab_size=32, lr=1e-2,
                            warmup=2, compute_dtype="float32", checkpoint_every=3)
    kw = dict(aux_layers=AUX, progress=False, log_every=1)
    full, hist_full = train_eagle3(target, corpus, str(tmp_path / "full"), cfg, **kw)

    real_batches = data_mod.batches

    def interrupted(*a, **k):
        it = real_batches(*a, **k)
        for _ in range(3):
            yield next(it)
        raise KeyboardInterrupt("simulated interruption after step 3")

    out = str(tmp_path / "resumed")
    monkeypatch.setattr(data_mod, "batches", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_eagle3(target, corpus, out, cfg, **kw)
    monkeypatch.undo()
    assert json.load(open(os.path.join(out, "checkpoint", common.META)))["step"] == 3
    resumed, hist = train_eagle3(target, corpus, out, cfg, **kw)
    assert [h["step"] for h in hist] == [4, 5, 6]
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in hist_full[3:]], rtol=1e-6)
    chex.assert_trees_all_close(resumed.weights, full.weights, atol=1e-6, rtol=1e-6)
    # And the 6 steps did move the weights (the comparison is not between two initialisations).
    init = init_head(target, full.config, np.asarray(full.weights["d2t"]), cfg.seed)
    assert float(jnp.abs(full.weights["params"]["fc"]["kernel"] - init["fc"]["kernel"]).max()) > 1e-3


def test_make_optimizer_schedule_and_clipping():
    lr, steps, warmup = 1e-2, 20, 4
    opt = common.make_optimizer(lr, steps, warmup, weight_decay=0.0, clip=1.0)
    params = {"w": jnp.zeros(2)}
    g = {"w": jnp.array([0.6, -0.8])}  # norm 1: not clipped
    state = opt.init(params)
    lrs = []
    for _ in range(steps + 3):
        u, state = opt.update(g, state, params)
        # A constant gradient makes Adam's m_hat / sqrt(v_hat) = sign(g): the update is -lr_t * sign(g).
        lrs.append(float(-u["w"][0]))
        np.testing.assert_allclose(np.asarray(u["w"]), [-lrs[-1], lrs[-1]], rtol=1e-5)
    lrs = np.array(lrs)
    np.testing.assert_allclose(lrs[: warmup + 1], lr * np.arange(warmup + 1) / warmup, rtol=1e-5, atol=1e-9)
    assert lrs[0] == 0.0 and lrs.max() == pytest.approx(lr, rel=1e-5) and lrs.argmax() == warmup
    assert np.all(np.diff(lrs[warmup: steps + 1]) < 0)  # cosine decay after the warm-up
    mid = (warmup + steps) // 2
    np.testing.assert_allclose(lrs[mid], lr * 0.1 + 0.5 * (lr - lr * 0.1), rtol=1e-5)  # half way down
    np.testing.assert_allclose(lrs[steps:], lr * 0.1, rtol=1e-5)  # ends (and stays) at lr/10

    # Global-norm clipping comes before Adam: a gradient above the norm acts as its
    # unit-norm version, so a huge spike moves the weights no more than a unit gradient.
    def second_update(clip, g2):
        o = common.make_optimizer(lr, steps, 1, weight_decay=0.0, clip=clip)
        st = o.init(params)
        _, st = o.update({"w": jnp.array([0.5, 0.0])}, st, params)
        return np.asarray(o.update({"w": jnp.asarray(g2, jnp.float32)}, st, params)[0]["w"])

    spike, unit = [3e6, 4e6], [0.6, 0.8]
    clipped = second_update(1.0, spike)
    np.testing.assert_allclose(clipped, second_update(1.0, unit), rtol=1e-5)
    assert np.all(np.isfinite(clipped)) and np.abs(clipped).max() <= 2 * lr
    assert not np.allclose(second_update(1e30, spike), clipped, rtol=1e-3)  # without clipping it differs


def test_lm_training_and_target_export_load_in_transformers(tmp_path):
    cfg = jspec.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16, tie_word_embeddings=True, eos_token_ids=(1,))
    stream = np.tile(np.arange(2, 20, dtype=np.int32), 50)
    w, hist = train_lm(cfg, data_mod.batches(stream, 8, 16, 0), 40, lr=1e-2, warmup=2, progress=False, log_every=1)
    assert hist[-1]["loss"] < hist[0]["loss"] - 1.0
    out = str(tmp_path / "lm")
    save_target(out, cfg, w)
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    toks = np.array([[2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        ref = hf(torch.tensor(toks)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jspec.logits(jspec.load(out), toks)), ref, atol=1e-4)


def test_training_bad_input(target, llama_dir, corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    cfg = Eagle3TrainConfig(steps=2, batch_size=2, seq_len=8, compute_dtype="float32")
    with pytest.raises(ValueError, match="corpus is empty"):
        train_eagle3(target, str(empty), None, cfg, aux_layers=AUX, progress=False)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3")
    with pytest.raises(ValueError, match="bad.txt.*not UTF-8"):
        train_eagle3(target, [str(bad)], None, cfg, aux_layers=AUX, progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        train_eagle3(target, [str(tmp_path / "nope.txt")], None, cfg, progress=False)
    jl = tmp_path / "x.jsonl"
    jl.write_text('{"content": "no text field"}\n')
    with pytest.raises(ValueError, match="x.jsonl:1: expected an object with a string 'text'"):
        train_eagle3(target, [str(jl)], None, cfg, progress=False)
    with pytest.raises(ValueError, match="seq_len"):
        Eagle3TrainConfig(seq_len=4, ttt_steps=4)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train_eagle3(target, corpus, None, Eagle3TrainConfig(steps=1, draft_vocab_size=10 ** 6), progress=False)
    # A draft made for another target (other hidden size) does not load against this one.
    other = str(tmp_path / "other")
    tiny_models.make_model(other, "llama", hidden=96, layers=4, tokenizer=True)
    head = str(tmp_path / "other_head")
    tiny_models.make_random_draft(head, "eagle3", jspec.load(other), seed=3)
    with pytest.raises(ValueError, match="hidden size"):
        jspec.load(llama_dir[0], draft=head)
    # The CLI reports errors without a traceback.
    assert cli_main(["eagle3", "--target", llama_dir[0], "--data", str(empty), "--out", str(tmp_path / "o"),
                     "--steps", "1"]) == 2
    # Invalid settings are refused before any training, and nothing is exported.
    for bad_cfg in (dict(lr=float("nan")), dict(lr=-1e-3), dict(lr=0.0), dict(clip=float("inf")),
                    dict(weight_decay=-0.1), dict(draft_vocab_size=0), dict(intermediate_size=0)):
        with pytest.raises(ValueError, match=next(iter(bad_cfg))):
            Eagle3TrainConfig(**bad_cfg)
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    with pytest.raises(ValueError, match="not a directory"):
        train_eagle3(target, corpus, str(a_file), cfg, progress=False)
    assert a_file.read_text() == "keep me"
    for aux in ((0, 1, 2), (1, 2, 5)):
        with pytest.raises(ValueError, match="auxiliary layers"):
            train_eagle3(target, corpus, str(tmp_path / "h"), cfg, aux_layers=aux, progress=False)
    assert not (tmp_path / "h").exists()
    for flags in (["--lr", "nan"], ["--lr", "-1"], ["--draft-vocab", "0"], ["--aux-layer-ids", "-1", "1", "2"]):
        out = str(tmp_path / "cli_out")
        assert cli_main(["eagle3", "--target", llama_dir[0], "--data", str(corpus), "--out", out, "--steps", "1",
                         *flags]) == 2, flags
        assert not os.path.exists(out)
    # Loading follows the same rule: a head reading the embeddings (id -1) is refused.
    with open(os.path.join(head, "config.json")) as f:
        head_cfg = json.load(f)
    head_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [-1, 1, 2]
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump(head_cfg, f)
    with pytest.raises(ValueError, match=r"EAGLE-3 auxiliary layers \(0, 2, 3\) .* do not fit a 4-layer target: "
                                         r"each must be in 1..4 \(ids 0..3\); set eagle_config"):
        jspec.load(other, draft=head)
    # Shallow targets: the defaults fit any depth. A new user's first try on a 3-layer model
    # trains, and the head loads and drafts.
    three = str(tmp_path / "three")
    tiny_models.make_model(three, "llama", layers=3, tokenizer=True)
    out = str(tmp_path / "three_head")
    assert cli_main(["eagle3", "--target", three, "--data", str(corpus), "--out", out, "--steps", "1",
                     "--batch-size", "1", "--seq-len", "8"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 0, 0]
    p3 = jspec.load(three, draft=out)
    assert p3.draft.config.aux_layers == (2, 1, 1)
    assert len(jspec.generate(p3, [5, 6, 7], max_new_tokens=3, stop_token_ids=[]).tokens) == 3
