"""EAGLE draft heads as Flax modules.

EAGLE (1/2): fc([token embedding; target feature]) -> decoder layer(s), the first without
its input norm -> hidden. The target's final-norm hidden state is the feature, and the
target's LM head turns the draft's hidden into logits.

EAGLE-3 (`LlamaForCausalLMEagle3`): fc projects the concatenated target features (inputs of
three target layers, [3*Dt]) to D; one decoder layer whose attention reads
[input_layernorm(embedding); hidden_norm(feature)] (2D wide); `norm` + its own `lm_head`
over a draft vocabulary (d2t maps draft ids to target ids). Its pre-norm output is the
feature of the next draft step.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec.cache.kv import KVCache
from jspec.config import ModelConfig
from jspec.tuning import DEFAULT_TUNING, Tuning
from jspec.models.llama import MLP, Attention, DecoderLayer
from jspec.models.layers import Linear, RMSNorm


class Eagle1Head(nn.Module):
    """(embeds [B,T,D], feats [B,T,D]) -> hidden [B,T,D] (fed to the target's LM head)."""

    cfg: ModelConfig
    fc_bias: bool = True
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, embeds, feats, cache: KVCache, meta):
        c = self.cfg
        x = Linear(c.hidden_size, self.fc_bias, c.dtype, tuning=self.tuning, name="fc")(
            jnp.concatenate([embeds, feats], axis=-1))
        kvs = []
        for i in range(c.num_layers):
            x, kv = DecoderLayer(c, c.sliding_windows[i], input_norm=i > 0, tuning=self.tuning, name=f"layers_{i}")(
                x, None if cache is None else cache.kv[i], meta)
            kvs.append(kv)
        return x, None if cache is None else KVCache(kv=tuple(kvs))


class Eagle3Head(nn.Module):
    """(embeds [B,T,D], feats [B,T,F]) -> pre-norm hidden [B,T,D]; `head` gives draft logits.

    project=True: feats are the target's concatenated layer inputs (fc applies);
    project=False: feats are the draft's own previous output.
    """

    cfg: ModelConfig
    draft_vocab_size: int
    tuning: Tuning = DEFAULT_TUNING

    def setup(self):
        c = self.cfg
        self.fc = Linear(c.hidden_size, False, c.dtype, tuning=self.tuning)
        self.midlayer = Eagle3Layer(c, self.tuning)
        self.norm = RMSNorm(c.rms_norm_eps, c.dtype)
        self.lm_head = Linear(self.draft_vocab_size, False, c.dtype, float32_out=True, tuning=self.tuning)

    def __call__(self, embeds, feats, cache: KVCache, meta, project: bool):
        if project:
            feats = self.fc(feats)
        x, kv = self.midlayer(embeds, feats, None if cache is None else cache.kv[0], meta)
        return x, None if cache is None else KVCache(kv=(kv,))

    def head(self, hidden):
        """hidden [..., D] -> float32 logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    def init_all(self, embeds, feats, cache, meta):
        """Touches every parameter (for `init`)."""
        return self.head(self(embeds, feats, cache, meta, True)[0])


class Eagle3Layer(nn.Module):
    cfg: ModelConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, embeds, feats, kv, meta):
        c = self.cfg
        h = jnp.concatenate([RMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(embeds),
                             RMSNorm(c.rms_norm_eps, c.dtype, name="hidden_norm")(feats)], axis=-1)
        a, kv = Attention(c, c.sliding_windows[0], self.tuning, name="self_attn")(h, kv, meta)
        r = a + feats
        out = r + MLP(c, self.tuning, name="mlp")(RMSNorm(c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(r))
        return out, kv
