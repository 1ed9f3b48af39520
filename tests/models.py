"""Small models with stage markers, shared by tests, examples and benchmarks."""

import jax
import jax.numpy as jnp
import numpy as np

import mpmd


def mlp_params(rng, num_stages, width=16):
    return [{"w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
             "b": (0.1 * rng.standard_normal(width)).astype(np.float32)} for _ in range(num_stages)]


def mlp(params, x):
    for s, p in enumerate(params):
        x = jnp.tanh(x @ p["w"] + p["b"])
        if s < len(params) - 1:
            x = mpmd.pipeline_yield(x)
    return x


def mse_loss(model):
    def loss(params, mb):
        return jnp.mean((model(params, mb["x"]) - mb["y"]) ** 2)

    return loss


def regression_batch(rng, num_mb, mb_size, width):
    return {"x": rng.standard_normal((num_mb, mb_size, width)).astype(np.float32),
            "y": rng.standard_normal((num_mb, mb_size, width)).astype(np.float32)}


def skip_params(rng, width=16):
    return mlp_params(rng, 3, width)


def skip_model(params, x):
    """Stage 0's output feeds stage 2 directly (not through stage 1)."""
    h0 = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
    h0y = mpmd.pipeline_yield(h0)
    h1 = jnp.tanh(h0y @ params[1]["w"] + params[1]["b"])
    h1 = mpmd.pipeline_yield(h1)
    return jnp.tanh(h1 @ params[2]["w"] + params[2]["b"]) + h0


# ---- a small decoder-only transformer -------------------------------------------------------------
def transformer_params(rng, vocab=32, d=16, heads=2, num_blocks=2, seq=8, tied=False):
    def dense(i, o):
        return (rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32)

    p = {"embed": (0.5 * rng.standard_normal((vocab, d))).astype(np.float32),
         "pos": (0.1 * rng.standard_normal((seq, d))).astype(np.float32),
         "blocks": [{"qkv": dense(d, 3 * d), "o": dense(d, d), "ff1": dense(d, 2 * d), "ff2": dense(2 * d, d),
                     "ln1": np.ones(d, np.float32), "ln2": np.ones(d, np.float32)} for _ in range(num_blocks)]}
    if not tied:
        p["head"] = dense(d, vocab)
    return p


def _layer_norm(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return g * (x - mu) / jnp.sqrt(var + 1e-5)


def _block(p, x, heads):
    b, t, d = x.shape
    h = _layer_norm(x, p["ln1"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    split = lambda z: z.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)
    att = (q @ k.transpose(0, 1, 3, 2)) / np.sqrt(d // heads)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    out = (jax.nn.softmax(att, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + out @ p["o"]
    return x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["ff1"]) @ p["ff2"]


def transformer(params, tokens, heads=2, num_stages=2):
    """Embedding and the first blocks on stage 0, the rest and the head on the last stage."""
    x = params["embed"][tokens] + params["pos"]
    blocks = params["blocks"]
    per = max(1, len(blocks) // num_stages)
    for i, p in enumerate(blocks):
        if i > 0 and i % per == 0 and i // per < num_stages:
            x = mpmd.pipeline_yield(x)
        x = _block(p, x, heads)
    head = params["head"] if "head" in params else params["embed"].T
    return x @ head


def lm_loss(params, mb):
    logits = transformer(params, mb["tokens"])
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, mb["targets"][..., None], -1))


def lm_batch(rng, num_mb, mb_size, seq=8, vocab=32):
    toks = rng.integers(0, vocab, size=(num_mb, mb_size, seq + 1)).astype(np.int32)
    return {"tokens": toks[..., :-1], "targets": toks[..., 1:]}
