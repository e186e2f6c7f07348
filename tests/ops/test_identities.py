"""Algebraic identities between the mixers, closed-form (recurrence-free) references, and the article's
worked examples."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from k3.ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_linear_attn,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_kda,
    recurrent_linear_attn,
)

from .helpers import (
    BASIC_MIXERS,
    DELTA,
    GDN,
    KDA,
    KDA_HARD,
    LINEAR,
    TOL_F64,
    assert_rel,
    make_inputs,
    mixer_params,
)

FORMS = {
    "kda": (recurrent_kda, chunk_kda),
    "gdn": (recurrent_gated_delta_rule, chunk_gated_delta_rule),
    "delta": (recurrent_delta_rule, chunk_delta_rule),
}


def both_forms(name):
    """[(label, callable)]: the recurrent form and the chunk form at chunk sizes 1, 2 and 64."""
    recurrent, chunk = FORMS[name]
    return [("recurrent", recurrent)] + [(f"chunk{C}", partial(chunk, chunk_size=C)) for C in (1, 2, 64)]


def form_params(name):
    return [pytest.param(label, fn, id=label) for label, fn in both_forms(name)]


def assert_exact(actual, expected, what=""):
    """Equal up to float64 rounding (absolute 1e-12 on O(1) numbers)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------------------------------
# 6. identities between mixers


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_kda_with_channel_equal_gate_is_gated_delta_rule(form):
    """KDA whose per-channel gate is the same on every channel == Gated DeltaNet with that scalar gate."""
    x = make_inputs(GDN, B=2, T=70, H=3, K=12, V=7, seed=1, initial_state=True, gate_kind="hard")
    g_channel = x["g"].unsqueeze(-1).expand(-1, -1, -1, 12).contiguous()
    idx = 0 if form == "recurrent" else 1
    kw = {} if form == "recurrent" else {"chunk_size": 16}
    o_g, s_g = FORMS["gdn"][idx](**x, output_final_state=True, **kw)
    o_k, s_k = FORMS["kda"][idx](**dict(x, g=g_channel), output_final_state=True, **kw)
    assert_rel(o_k, o_g, TOL_F64, "o")
    assert_rel(s_k, s_g, TOL_F64, "final state")


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_zero_gate_is_delta_rule(form):
    """Gated DeltaNet with g = 0 (and KDA with g = 0) == the plain delta rule."""
    x = make_inputs(DELTA, B=2, T=70, H=3, K=12, V=7, seed=2, initial_state=True)
    idx = 0 if form == "recurrent" else 1
    kw = {} if form == "recurrent" else {"chunk_size": 16}
    o_d, s_d = FORMS["delta"][idx](**x, output_final_state=True, **kw)
    g_head = torch.zeros(2, 70, 3, dtype=torch.float64)
    o_g, s_g = FORMS["gdn"][idx](**x, g=g_head, output_final_state=True, **kw)
    assert_rel(o_g, o_d, TOL_F64, "gdn o")
    assert_rel(s_g, s_d, TOL_F64, "gdn final state")
    o_k, s_k = FORMS["kda"][idx](**x, g=torch.zeros(2, 70, 3, 12, dtype=torch.float64), output_final_state=True, **kw)
    assert_rel(o_k, o_d, TOL_F64, "kda o")
    assert_rel(s_k, s_d, TOL_F64, "kda final state")


@pytest.mark.parametrize("mixer", mixer_params([KDA, GDN, DELTA]))
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_unit_key_full_write_reads_back_value(mixer, form):
    """With a unit key, beta = 1 and q = k (scale 1), every step reads back exactly the value it just
    wrote (the old binding is replaced), whatever the gate and the prior state."""
    x = make_inputs(mixer, B=1, T=40, H=2, K=8, V=5, seed=3, initial_state=True)
    x["q"], x["beta"] = x["k"], torch.ones_like(x["beta"])
    kw = {} if form == "recurrent" else {"chunk_size": 16}
    o, _ = mixer(form, x, scale=1.0, **kw)
    assert_rel(o, x["v"], TOL_F64, "read-back")


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_scale_multiplies_q(mixer, form):
    """scale=None means K**-0.5, and op(q, scale=s) == op(s * q, scale=1)."""
    x = make_inputs(mixer, B=1, T=20, H=2, K=9, V=4, seed=4, initial_state=True)
    kw = {} if form == "recurrent" else {"chunk_size": 8}
    o_default, _ = mixer(form, x, **kw)
    o_explicit, _ = mixer(form, x, scale=9**-0.5, **kw)
    assert_rel(o_default, o_explicit, TOL_F64, "default scale")
    o_s, s_s = mixer(form, x, scale=0.37, output_final_state=True, **kw)
    o_1, s_1 = mixer(form, dict(x, q=0.37 * x["q"]), scale=1.0, output_final_state=True, **kw)
    assert_rel(o_s, o_1, TOL_F64, "scale folded into q")
    assert_rel(s_s, s_1, TOL_F64, "state does not depend on the scale")


# ----------------------------------------------------------------------------------------------------
# 6. chunk_size = T equals a closed-form masked computation


def delta_rule_closed_form(q, k, v, beta, S0, scale):
    """The delta rule over one chunk without a recurrence, per sequence and head (float64):
    A = tril(Diag(beta) K K^T, -1), U = (I + A)^-1 Diag(beta) (V - K S0),
    O = scale Q S0 + tril(scale Q K^T) U,  S_T = S0 + K^T U."""
    B, T, H, _ = q.shape
    o = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64)
    S = torch.empty_like(S0)
    eye = torch.eye(T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            Q, Kk, Vv, bt, S0bh = q[b, :, h], k[b, :, h], v[b, :, h], beta[b, :, h], S0[b, h]
            A = torch.tril(torch.diag(bt) @ Kk @ Kk.T, -1)
            U = torch.linalg.inv(eye + A) @ torch.diag(bt) @ (Vv - Kk @ S0bh)
            o[b, :, h] = scale * Q @ S0bh + torch.tril(scale * Q @ Kk.T) @ U
            S[b, h] = S0bh + Kk.T @ U
    return o, S


def gated_closed_form(q, k, v, g, beta, S0, scale):
    """The gated delta rule (g [B,T,H,K] per channel) over one chunk without a recurrence (float64):
    G = cumsum(g), D_ric = exp(G_rc - G_ic) for i <= r, A_ri = beta_r sum_c k_rc k_ic D_ric (i < r),
    U = (I + A)^-1 Diag(beta) (V - (K * e^G) S0), O = scale ((Q * e^G) S0 + Aqk U) with
    Aqk_ri = sum_c q_rc k_ic D_ric (i <= r), S_T = Diag(e^G_T) S0 + (K * e^(G_T - G))^T U."""
    B, T, H, _ = q.shape
    o = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64)
    S = torch.empty_like(S0)
    eye = torch.eye(T, dtype=torch.float64)
    incl = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(B):
        for h in range(H):
            Q, Kk, Vv, bt, S0bh = q[b, :, h], k[b, :, h], v[b, :, h], beta[b, :, h], S0[b, h]
            G = g[b, :, h].cumsum(0)  # [T, K]
            diff = (G[:, None, :] - G[None, :, :]).masked_fill(~incl[..., None], -math.inf)
            D = torch.exp(diff)  # [T, T, K], zero above the diagonal
            A = torch.einsum("rc,ic,ric->ri", Kk, Kk, D).tril(-1) * bt[:, None]
            Aqk = torch.einsum("rc,ic,ric->ri", Q, Kk, D)
            U = torch.linalg.inv(eye + A) @ torch.diag(bt) @ (Vv - (Kk * G.exp()) @ S0bh)
            o[b, :, h] = scale * ((Q * G.exp()) @ S0bh + Aqk @ U)
            S[b, h] = G[-1].exp()[:, None] * S0bh + (Kk * (G[-1] - G).exp()).T @ U
    return o, S


@pytest.mark.parametrize("chunk_size", [50, 64, 1000], ids=["C=T", "C>T", "C>>T"])
def test_delta_rule_single_chunk_matches_closed_form(chunk_size):
    """chunk_delta_rule with one chunk covering the sequence (chunk_size >= T) == the closed-form UT
    transform computed with torch.linalg.inv; the recurrence agrees too."""
    x = make_inputs(DELTA, B=2, T=50, H=2, K=7, V=5, seed=5, initial_state=True)
    scale = 7**-0.5
    o_ref, s_ref = delta_rule_closed_form(x["q"], x["k"], x["v"], x["beta"], x["initial_state"], scale)
    o, s = chunk_delta_rule(**x, output_final_state=True, chunk_size=chunk_size)
    assert_rel(o, o_ref, TOL_F64, "chunk o")
    assert_rel(s, s_ref, TOL_F64, "chunk final state")
    o, s = recurrent_delta_rule(**x, output_final_state=True)
    assert_rel(o, o_ref, TOL_F64, "recurrent o")
    assert_rel(s, s_ref, TOL_F64, "recurrent final state")


@pytest.mark.parametrize("mixer", mixer_params([KDA, KDA_HARD, GDN]))
def test_gated_single_chunk_matches_closed_form(mixer):
    """chunk_kda / chunk_gated_delta_rule with chunk_size = T == the closed-form gated UT transform
    (pairwise decays exp(G_r - G_i) formed explicitly); the recurrence agrees too."""
    T, K = 48, 6
    x = make_inputs(mixer, B=2, T=T, H=2, K=K, V=5, seed=6, initial_state=True)
    g = x["g"] if x["g"].dim() == 4 else x["g"].unsqueeze(-1).expand(-1, -1, -1, K)
    o_ref, s_ref = gated_closed_form(x["q"], x["k"], x["v"], g, x["beta"], x["initial_state"], K**-0.5)
    o, s = mixer("chunk", x, output_final_state=True, chunk_size=T)
    assert_rel(o, o_ref, TOL_F64, "chunk o")
    assert_rel(s, s_ref, TOL_F64, "chunk final state")
    o, s = mixer("recurrent", x, output_final_state=True)
    assert_rel(o, o_ref, TOL_F64, "recurrent o")
    assert_rel(s, s_ref, TOL_F64, "recurrent final state")


@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attn_single_chunk_matches_masked_attention(normalize):
    """chunk_linear_attn with chunk_size = T == masked attention without softmax:
    O = scale Q S0 + tril(scale Q K^T) V, divided by scale Q z0 + tril(scale Q K^T) 1 + eps if normalized;
    final state (S0 + K^T V, z0 + sum k)."""
    T, K = 40, 6
    x = make_inputs(LINEAR, B=2, T=T, H=2, K=K, V=5, seed=7, initial_state=True)
    S0, z0 = x["initial_state"]
    Q, Kk, Vv = (t.transpose(1, 2) for t in (x["q"], x["k"], x["v"]))  # [B, H, T, d]
    scale = K**-0.5
    scores = torch.tril(scale * Q @ Kk.transpose(-1, -2))
    num = scale * Q @ S0 + scores @ Vv
    den = scale * Q @ z0.unsqueeze(-1) + scores.sum(-1, keepdim=True) + 1e-6
    o_ref = (num / den if normalize else num).transpose(1, 2)
    s_ref = (S0 + Kk.transpose(-1, -2) @ Vv, z0 + Kk.sum(-2))
    forms = [("recurrent", recurrent_linear_attn), ("chunk", partial(chunk_linear_attn, chunk_size=T))]
    for name, fn in forms:
        o, s = fn(**x, normalize=normalize, output_final_state=True)
        assert_rel(o, o_ref, TOL_F64, f"{name} o")
        assert_rel(s, s_ref, TOL_F64, f"{name} final state")

    # Without the initial state and normalisation: exactly tril(Q K^T) V with scale 1.
    del x["initial_state"]
    o, _ = chunk_linear_attn(**x, scale=1.0, normalize=False, chunk_size=T)
    o_ref = (torch.tril(Q @ Kk.transpose(-1, -2)) @ Vv).transpose(1, 2)
    assert_rel(o, o_ref, TOL_F64, "tril(QK^T)V")


# ----------------------------------------------------------------------------------------------------
# 7. the article's worked examples


@pytest.mark.parametrize("form,fn", form_params("delta"))
def test_article_delta_rule_overwrite(form, fn):
    """Article example: key k = [1, 3] holds v_old = [2, 4] (S_old = k^T v_old). The delta rule reads
    the old value with k/|k|^2 and writes S_total = S_old + k^T (v_new - (k/|k|^2) S_old) for
    v_new = [0, 1]: S_total = [[0, 1], [0, 3]] = k^T v_new, and the read returns [0, 1].

    The op writes beta * k^T (v - k S'); beta = 1/|k|^2 and v = |k|^2 v_new express the article's step
    exactly. Step 1 (beta = 0, no write) reads the old value, step 2 overwrites and reads the new one."""
    f64 = torch.float64
    k = torch.tensor([1.0, 3.0], dtype=f64)
    v_old, v_new = torch.tensor([2.0, 4.0], dtype=f64), torch.tensor([0.0, 1.0], dtype=f64)
    S_old = torch.outer(k, v_old)
    assert torch.equal(S_old, torch.tensor([[2.0, 4.0], [6.0, 12.0]], dtype=f64))
    norm2 = float(k @ k)  # |k|^2 = 10
    read = k / norm2
    q = torch.stack([read, read]).view(1, 2, 1, 2)
    keys = torch.stack([k, k]).view(1, 2, 1, 2)
    v = torch.stack([torch.zeros(2, dtype=f64), norm2 * v_new]).view(1, 2, 1, 2)
    beta = torch.tensor([0.0, 1.0 / norm2], dtype=f64).view(1, 2, 1)
    o, S = fn(q, keys, v, beta, scale=1.0, initial_state=S_old.view(1, 1, 2, 2), output_final_state=True)
    S_total = torch.tensor([[0.0, 1.0], [0.0, 3.0]], dtype=f64)
    assert_exact(o[0, 0, 0], v_old)  # before: reads [2, 4]
    assert_exact(S[0, 0], S_total)
    assert_exact(S[0, 0], torch.outer(k, v_new))
    assert_exact(o[0, 1, 0], v_new)  # after: reads [0, 1]


@pytest.mark.parametrize("form,fn", form_params("delta"))
def test_article_delta_rule_overwrite_unit_key(form, fn):
    """The same overwrite with the op's native unit key khat = k/|k| and beta = 1: from the article's
    S_old the step gives S_new = S_old + khat^T (v_new - khat S_old) = khat^T v_new = S_total / |k|, and
    reading with khat returns v_new = [0, 1] exactly."""
    f64 = torch.float64
    k = torch.tensor([1.0, 3.0], dtype=f64)
    khat = k / k.norm()
    v_old, v_new = torch.tensor([2.0, 4.0], dtype=f64), torch.tensor([0.0, 1.0], dtype=f64)
    S_old = torch.outer(k, v_old)
    o, S = fn(
        khat.view(1, 1, 1, 2),
        khat.view(1, 1, 1, 2),
        v_new.view(1, 1, 1, 2),
        torch.ones(1, 1, 1, dtype=f64),
        scale=1.0,
        initial_state=S_old.view(1, 1, 2, 2),
        output_final_state=True,
    )
    S_total = torch.tensor([[0.0, 1.0], [0.0, 3.0]], dtype=f64)
    assert_exact(S[0, 0], S_total / math.sqrt(10.0))
    assert_exact(o[0, 0, 0], v_new)


ALPHA = [0.8, 0.5, 0.9]
GAMMA = [0.8, 0.4, 0.36]  # cumulative products
DECAY_MATRIX = [[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.45, 0.9, 1.0]]  # gamma_r / gamma_i, i <= r


def _gate(kind, values, K):
    g = torch.tensor(values, dtype=torch.float64).log().view(1, len(values), 1)
    return g if kind == "gdn" else g.unsqueeze(-1).expand(1, len(values), 1, K).contiguous()


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_article_cumulative_decay(kind):
    """Article example alpha = [0.8, 0.5, 0.9]: with no writes (beta = 0) the state decays by the
    cumulative products gamma = [0.8, 0.4, 0.36], so o_r = q_r gamma_r S0 (recurrent and chunk forms)."""
    f64 = torch.float64
    S0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=f64).view(1, 1, 2, 2)
    q = torch.tensor([1.0, 0.0], dtype=f64).expand(1, 3, 1, 2)
    k = torch.tensor([0.6, 0.8], dtype=f64).expand(1, 3, 1, 2)
    torch.manual_seed(0)
    v = torch.randn(1, 3, 1, 2, dtype=f64)
    beta = torch.zeros(1, 3, 1, dtype=f64)
    expected = torch.tensor(GAMMA, dtype=f64)[:, None] * torch.tensor([1.0, 2.0], dtype=f64)
    for form, fn in both_forms(kind):
        o, S = fn(q, k, v, _gate(kind, ALPHA, 2), beta, scale=1.0, initial_state=S0, output_final_state=True)
        assert_exact(o[0, :, 0], expected, form)
        assert_exact(S, 0.36 * S0, form)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_article_decay_matrix(kind):
    """Article example alpha = [0.8, 0.5, 0.9]: a write at step i reaches step r >= i scaled by
    gamma_r / gamma_i, the lower-triangular matrix [[1, 0, 0], [0.5, 1, 0], [0.45, 0.9, 1]].

    Writes use orthonormal keys e_i (so they never interact), beta = 1 and one-hot values e_i; reading
    with q = e_1 + e_2 + e_3 then returns row r of that matrix at step r."""
    f64 = torch.float64
    eye = torch.eye(3, dtype=f64)
    k = eye.view(1, 3, 1, 3)
    v = eye.view(1, 3, 1, 3)
    q = torch.ones(1, 3, 1, 3, dtype=f64)
    beta = torch.ones(1, 3, 1, dtype=f64)
    expected = torch.tensor(DECAY_MATRIX, dtype=f64)
    for form, fn in both_forms(kind):
        o, S = fn(q, k, v, _gate(kind, ALPHA, 3), beta, scale=1.0, output_final_state=True)
        assert_exact(o[0, :, 0], expected, form)
        # the final state keeps write i at key row i, decayed by gamma_3 / gamma_i
        assert_exact(S[0, 0], torch.diag(expected[-1]), form)
