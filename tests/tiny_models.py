"""Tiny random Hugging Face models saved to temp dirs, for tests (nothing from a hub)."""
from __future__ import annotations

import functools
import os

import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
VOCAB = 300


def hf_config(family: str = "llama", *, tie: bool = False, vocab: int = VOCAB, hidden: int = 64,
              layers: int = 2, heads: int = 4, kv_heads: int = 2, inter: int = 128, **kw):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  initializer_range=0.2)
    common.update(kw)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        common.setdefault("head_dim", 32)
        return transformers.Qwen3Config(**common)
    if family == "mistral":
        common.setdefault("sliding_window", None)
        return transformers.MistralConfig(**common)
    raise ValueError(family)


def save_tokenizer(path: str):
    """A byte-level tokenizer: 3 specials (<pad>, <s>, </s>) then the 256 byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    table = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch, b in _bytes_to_unicode().items():
        table[ch] = 3 + b
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(path)


def _bytes_to_unicode():
    """GPT-2's printable stand-in character for each byte: {char: byte}."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def make_model(path: str, family: str = "llama", *, seed: int = 0, tokenizer: bool = False,
               dtype=torch.float32, max_shard_size=None, **kw) -> transformers.PreTrainedModel:
    cfg = hf_config(family, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    randomize_biases_and_norms(model, seed)
    model = model.to(dtype).eval()
    os.makedirs(path, exist_ok=True)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **extra)
    if tokenizer:
        save_tokenizer(path)
    return model


def randomize_biases_and_norms(model, seed: int = 0):
    """transformers initialises biases to 0 and RMSNorm weights to 1, which would hide a bias
    or norm weight that is dropped, misnamed or swapped; give them random values instead
    (biases 0.1 * N(0, 1), norm weights 1 + 0.1 * N(0, 1); deterministic in `seed`)."""
    gen = torch.Generator().manual_seed(10_007 + seed)
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:  # input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                continue
            n += 1
    return n


@functools.lru_cache(maxsize=None)
def _hf_greedy_cached(model_id: int, prompt: tuple, n: int, stop: tuple):
    model = _MODELS[model_id]
    ids = torch.tensor([list(prompt)])
    eos = list(stop) if stop else None
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_MODELS: dict = {}


def hf_greedy(model, prompt, n: int, stop=()):
    """transformers' own greedy continuation of one prompt (the reference)."""
    _MODELS[id(model)] = model
    return _hf_greedy_cached(id(model), tuple(prompt), n, tuple(stop))


def make_random_draft(path: str, kind: str, target, *, seed: int, draft_vocab: int | None = None,
                      aux_layers: tuple | None = None):
    """A random draft of `kind` (eagle, eagle3, standalone, dflash) for `target` (jspec
    Params), saved in its checkpoint format (an EAGLE-3 head captures the target layers
    `aux_layers`; None: 1, 2, 3, each at most the target's layers)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.drafts import DFlashDraft, Eagle3Draft, EagleDraft, StandaloneDraft
    from jspec.export import save_draft

    tc = target.config
    V = tc.vocab_size
    m = tc.replace(num_layers=1, sliding_windows=(0,))
    if kind == "dflash":  # two Qwen3 layers reading the first and the last target layer; blocks of 6
        m = tc.replace(num_layers=2, sliding_windows=(0, 0), qk_norm=True, model_type="qwen3")
        d = DFlashDraft(m, target_layer_ids=(0, tc.num_layers - 1), num_target_layers=tc.num_layers, block_size=6,
                        mask_token_id=V - 1)
    elif kind == "standalone":
        m = tc.replace(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                       head_dim=16, sliding_windows=(0, 0))
        d = StandaloneDraft(m)
    elif kind == "eagle":
        d = EagleDraft(m, fc_bias=True)
    else:
        Vd = draft_vocab or V
        aux_layers = aux_layers or tuple(min(i, tc.num_layers) for i in (1, 2, 3))
        d = Eagle3Draft(m, target_hidden_size=tc.hidden_size, aux_layers=tuple(aux_layers),
                        draft_vocab_size=Vd)
    w = d.init(jax.random.key(seed), V)
    w = jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a, w)  # sharper random logits
    if "d2t" in w:
        ids = np.sort(np.random.RandomState(seed).choice(V, Vd, replace=False))
        w["d2t"] = jnp.asarray(ids - np.arange(Vd), jnp.int32)
    save_draft(path, d, w, V)


def make_permutation_family(root: str, *, vocab: int = VOCAB, hidden: int = 64, seed: int = 0):
    """Target with next(t) = pi(t) (pi one random cycle), plus drafts that agree with it.

    Target: every block's output projection is zero, so the final hidden is the token's
    unit embedding; lm_head row v is 2 * e[pi^-1(v)], so the argmax is pi(t).
    EAGLE head: fc = [8I, 0] keeps the token half, blocks zero: it predicts pi(token).
    EAGLE-3 head: fc keeps the first captured feature (the embedding of the token at the
    slot), blocks zero, lm_head row v = 2 * e[pi^-2(v)]: its first draft is right, the
    later ones (which see the draft's own hidden) are not, so it accepts exactly 1 per round.
    """
    import jax
    import numpy as np

    from jspec.config import ModelConfig
    from jspec.drafts import Eagle3Draft, EagleDraft
    from jspec.export import save_draft, save_target
    from jspec.models.llama import LLAMA

    rng = np.random.RandomState(seed)
    order = rng.permutation(vocab)
    pi = np.empty(vocab, np.int64)
    pi[order] = np.roll(order, -1)  # one cycle through every token
    inv = np.argsort(pi)
    e = rng.randn(vocab, hidden).astype(np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16, bos_token_id=1, eos_token_ids=(2,))
    params = LLAMA.init_weights(cfg, jax.random.key(seed))
    p = jax.tree.map(np.array, params["params"])
    p["embed_tokens"]["embedding"] = e
    p["lm_head"]["kernel"] = (2 * e[inv]).T
    for i in range(cfg.num_layers):
        p[f"layers_{i}"]["self_attn"]["o_proj"]["kernel"][:] = 0
        p[f"layers_{i}"]["mlp"]["down_proj"]["kernel"][:] = 0
    tdir = os.path.join(root, "target")
    save_target(tdir, cfg, {"params": p})

    m = cfg.replace(num_layers=1, sliding_windows=(0,))
    eye = np.eye(hidden, dtype=np.float32)
    d1 = EagleDraft(m, fc_bias=True)
    w1 = jax.tree.map(np.array, d1.init(jax.random.key(1), vocab))
    w1["params"]["fc"]["kernel"] = np.concatenate([8 * eye, 0 * eye], axis=1).T
    w1["params"]["fc"]["bias"][:] = 0
    w1["params"]["layers_0"]["self_attn"]["o_proj"]["kernel"][:] = 0
    w1["params"]["layers_0"]["mlp"]["down_proj"]["kernel"][:] = 0
    e1dir = os.path.join(root, "eagle")
    save_draft(e1dir, d1, w1, vocab)

    d3 = Eagle3Draft(m, target_hidden_size=hidden, aux_layers=(1, 2, 3), draft_vocab_size=vocab)
    w3 = jax.tree.map(np.array, d3.init(jax.random.key(2), vocab))
    w3["params"]["fc"]["kernel"] = np.concatenate([8 * eye, 0 * eye, 0 * eye], axis=1).T
    w3["params"]["midlayer"]["self_attn"]["o_proj"]["kernel"][:] = 0
    w3["params"]["midlayer"]["mlp"]["down_proj"]["kernel"][:] = 0
    w3["params"]["lm_head"]["kernel"] = (2 * e[inv[inv]]).T
    e3dir = os.path.join(root, "eagle3")
    save_draft(e3dir, d3, w3, vocab)
    return {"target": tdir, "eagle": e1dir, "eagle3": e3dir, "standalone": tdir, "pi": pi}
