"""Float64 NumPy oracles of the layers, written from the formulas (loops per sequence, per
token, per expert), not from the layer code; other test_layers_* modules import them. The
tests here pin the oracles themselves to hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _random_param(name: str, shape, rng: np.random.Generator) -> np.ndarray:
    """A random value for parameter `name`, in the range its real init or checkpoint has."""
    normal = rng.normal(size=shape)
    if name in ("kernel", "phi", "w_gate", "w_up", "w_down"):  # [..., in, out]
        return normal * shape[-2] ** -0.5
    if name in ("weight", "scale") and len(shape) == 1:  # norm gains
        return 1 + 0.2 * normal
    table = {
        "weight": lambda: 0.5 * normal,  # conv taps [C, W]
        "embedding": lambda: normal,
        "bias": lambda: 0.2 * normal,
        "A_log": lambda: np.log(rng.uniform(1, 16, size=shape)),
        "dt_bias": lambda: rng.uniform(-3, 1, size=shape),
        "alpha": lambda: rng.uniform(0.5, 2, size=shape),  # strong mHC maps
        "b_pre": lambda: 0.5 * normal,
        "b_post": lambda: 0.5 * normal,
        "b_res": lambda: 0.5 * normal,
        "e_score_correction_bias": lambda: 0.3 * normal,  # changes which experts win
    }
    return table[name]()


def random_module(factory, rng: np.random.Generator):
    """`factory()`'s module with every parameter drawn by `_random_param` (norm gains, biases
    and gates included, so no default value hides a mistake). The module is built under
    `nnx.eval_shape`, so no init op is compiled."""
    module = nnx.eval_shape(factory)

    def draw(path, leaf):
        name = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)][-1]
        return jnp.asarray(_random_param(name, leaf.shape, rng), leaf.dtype)

    nnx.update(module, jax.tree_util.tree_map_with_path(draw, nnx.state(module, nnx.Param)))
    return module


def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0, x)


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def random_lengths(rng, num_seqs, max_total, *, include=(0, 1)):
    """Sequence lengths summing to at most max_total, containing each of `include`."""
    lengths = list(include) + list(rng.integers(1, 12, size=num_seqs - len(include)))
    rng.shuffle(lengths)
    while sum(lengths) > max_total:
        lengths[int(np.argmax(lengths))] -= 1
    return np.array(lengths)


def cu_seqlens_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def conv_oracle(x, weight, cu_seqlens, history, offsets):
    """Depthwise causal conv + SiLU per sequence, its final history and history snapshots.

    x [T, C], weight [C, W], history [N, C, W-1] (oldest first), offsets [N, cap]."""
    x, weight, history = f64(x), f64(weight), f64(history)
    width = weight.shape[1]
    y = np.zeros_like(x)
    final = np.zeros_like(history)
    snaps = np.zeros((*offsets.shape, *history.shape[1:]))
    for n in range(len(cu_seqlens) - 1):
        start, end = cu_seqlens[n], cu_seqlens[n + 1]
        ext = np.concatenate([history[n].T, x[start:end]])  # row j = position j - (W - 1)
        for i in range(end - start):
            y[start + i] = silu(np.sum(ext[i : i + width].T * weight, axis=1))
        final[n] = ext[len(ext) - (width - 1) :].T
        for c, p in enumerate(offsets[n]):
            if p >= 0:
                snaps[n, c] = ext[p : p + width - 1].T
    return y, final, snaps


def kda_recurrence_oracle(q, k, v, g, beta, cu_seqlens, states, offsets, scale):
    """Token-by-token KDA (DESIGN section 2) per sequence and head."""
    q, k, v, g, beta, states = map(f64, (q, k, v, g, beta, states))
    o = np.zeros(v.shape)
    final = states.copy()
    snaps = np.zeros((*offsets.shape, *states.shape[1:]))
    for n in range(len(cu_seqlens) - 1):
        for h in range(q.shape[1]):
            s = states[n, h].copy()  # [K, V]
            for i, t in enumerate(range(cu_seqlens[n], cu_seqlens[n + 1])):
                s = np.exp(g[t, h])[:, None] * s
                s = s + beta[t, h] * np.outer(k[t, h], v[t, h] - s.T @ k[t, h])
                o[t, h] = scale * s.T @ q[t, h]
                for c, p in enumerate(offsets[n]):
                    if p == i + 1:
                        snaps[n, c, h] = s
            final[n, h] = s
    return o, final, snaps


def mla_oracle(p: dict, x, *, heads, nope, rope, v_dim, kv_lora, eps, select=None):
    """Causal MLA over one whole sequence x [L, D]; `select` [L, L] optionally narrows the
    keys each query sees (DSA). p holds float64 weights under upstream names."""
    length = x.shape[0]
    if "q_proj" in p:
        q = x @ p["q_proj"]
    else:
        q = rms_norm(x @ p["q_a_proj"], p["q_a_layernorm"], eps) @ p["q_b_proj"]
    q = q.reshape(length, heads, nope + rope)
    kv = x @ p["kv_a_proj_with_mqa"]
    c_kv = rms_norm(kv[:, :kv_lora], p["kv_a_layernorm"], eps)
    k_pe = kv[:, kv_lora:]
    expanded = (c_kv @ p["kv_b_proj"]).reshape(length, heads, nope + v_dim)
    out = np.zeros((length, heads, v_dim))
    for t in range(length):
        visible = np.arange(length) <= t
        if select is not None:
            visible &= select[t]
        for h in range(heads):
            keys = np.concatenate([expanded[:, h, :nope], k_pe], axis=1)  # [L, nope + rope]
            scores = keys @ q[t, h] / np.sqrt(nope + rope)
            scores = np.where(visible, scores, -np.inf)
            w = np.exp(scores - scores.max())
            out[t, h] = (w / w.sum()) @ expanded[:, h, nope:]
    return out.reshape(length, -1) @ p["o_proj"]


def swiglu_oracle(x, gate, up, down, limit):
    a, b = x @ gate, x @ up
    if limit is not None:
        a, b = np.minimum(a, limit), np.clip(b, -limit, limit)
    return (silu(a) * b) @ down


def moe_oracle(p: dict, x, *, top_k, scaling, limit):
    """Per token: sigmoid scores, biased selection, renormalised weights, expert loop."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        scores = sigmoid(x[t] @ p["router"])
        chosen = np.argsort(-(scores + p["bias"]), kind="stable")[:top_k]
        weights = scores[chosen] / scores[chosen].sum() * scaling
        for e, w in zip(chosen, weights):
            out[t] += w * swiglu_oracle(x[t], p["w_gate"][e], p["w_up"][e], p["w_down"][e], limit)
        out[t] += swiglu_oracle(x[t], p["shared_gate"], p["shared_up"], p["shared_down"], limit)
    return out


def sinkhorn_oracle(logits, iters):
    m = np.exp(logits)
    for _ in range(iters):
        m = m / m.sum(axis=1, keepdims=True)
        m = m / m.sum(axis=0, keepdims=True)
    return m


def mhc_oracle(p: dict, streams, sublayer, *, iters, eps):
    """X' = H_res X + H_post^T F(H_pre X), token by token; streams [T, n, D]."""
    tokens, n, _ = streams.shape
    inputs, maps = [], []
    for t in range(tokens):
        flat = streams[t].reshape(-1)
        proj = (flat / np.sqrt(np.mean(flat * flat) + eps)) @ p["phi"]
        pre = sigmoid(p["alpha"][0] * proj[:n] + p["b_pre"])
        post = 2 * sigmoid(p["alpha"][1] * proj[n : 2 * n] + p["b_post"])
        res = sinkhorn_oracle(p["alpha"][2] * proj[2 * n :].reshape(n, n) + p["b_res"], iters)
        inputs.append(pre @ streams[t])
        maps.append((post, res))
    y = sublayer(np.stack(inputs))
    return np.stack([res @ streams[t] + np.outer(post, y[t]) for t, (post, res) in enumerate(maps)])


def test_conv_oracle_by_hand():
    # One channel, taps [1, 0, 0, 2]: y_t = silu(x_{t-3} + 2 x_t).
    x = np.array([[1.0], [2.0]])
    history = np.array([[[5.0, 6.0, 7.0]]])
    y, final, snaps = conv_oracle(
        x, np.array([[1.0, 0, 0, 2]]), np.array([0, 2]), history, np.array([[1, -1]])
    )
    np.testing.assert_allclose(y[:, 0], silu(np.array([5 + 2, 6 + 4])))
    np.testing.assert_allclose(final[0, 0], [7, 1, 2])
    np.testing.assert_allclose(snaps[0, 0, 0], [6, 7, 1])
    np.testing.assert_allclose(snaps[0, 1], 0)


def test_kda_recurrence_oracle_one_token():
    # From S0, one token: S1 = e^g S0 + beta k (v - (e^g S0)^T k)^T, o = scale S1^T q.
    rng = np.random.default_rng(0)
    q, k, g = rng.normal(size=(3, 1, 1, 2))
    v = rng.normal(size=(1, 1, 3))
    s0 = rng.normal(size=(1, 1, 2, 3))
    beta = np.array([[0.3]])
    o, final, snaps = kda_recurrence_oracle(
        q, k, v, g, beta, np.array([0, 1]), s0, np.array([[1]]), scale=0.5
    )
    decayed = np.exp(g[0, 0])[:, None] * s0[0, 0]
    expected = decayed + 0.3 * np.outer(k[0, 0], v[0, 0] - decayed.T @ k[0, 0])
    np.testing.assert_allclose(final[0, 0], expected)
    np.testing.assert_allclose(snaps[0, 0, 0], expected)
    np.testing.assert_allclose(o[0, 0], 0.5 * expected.T @ q[0, 0])


def test_sinkhorn_oracle_is_doubly_stochastic():
    m = sinkhorn_oracle(np.random.default_rng(1).normal(size=(4, 4)), 200)
    np.testing.assert_allclose(m.sum(axis=0), 1, atol=1e-12)
    np.testing.assert_allclose(m.sum(axis=1), 1, atol=1e-9)
