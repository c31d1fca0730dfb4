"""vlserve.model.layers.gated_delta against transformers' torch reference (Qwen3.5's Gated DeltaNet): the
chunked and one-step delta rule, the causal conv, and the state carried between calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from vlserve.model.layers.gated_delta import causal_conv, causal_conv_step, chunk_gated_delta, gated_delta_step

TOL = dict(atol=2e-5, rtol=2e-5)


def inputs(T, hk=2, h=4, dk=16, dv=8, seed=0, batch=None):
    gen = torch.Generator().manual_seed(seed)
    lead = (T,) if batch is None else (batch, T)
    q = torch.randn(*lead, hk, dk, generator=gen)
    k = torch.randn(*lead, hk, dk, generator=gen)
    v = torch.randn(*lead, h, dv, generator=gen)
    g = -F.softplus(torch.randn(*lead, h, generator=gen)) * 0.5  # log decays <= 0
    beta = torch.rand(*lead, h, generator=gen)
    return q, k, v, g, beta


def reference(q, k, v, g, beta, state=None, recurrent=False):
    """transformers' functions on one sequence (batch of 1)."""
    fn = torch_recurrent_gated_delta_rule if recurrent else torch_chunk_gated_delta_rule
    out, final = fn(*(x.unsqueeze(0) for x in (q, k, v)), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
                    initial_state=None if state is None else state.unsqueeze(0), output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    return out.squeeze(0), final.squeeze(0)


@pytest.mark.parametrize("T", [1, 5, 64, 130])
def test_chunked_rule_matches_transformers(T):
    q, k, v, g, beta = inputs(T)
    state = torch.randn(4, 16, 8) * 0.3
    for init in (None, state):
        ref_out, ref_state = reference(q, k, v, g, beta, init)
        out, final, _ = chunk_gated_delta(q, k, v, g, beta, init)
        torch.testing.assert_close(out, ref_out, **TOL)
        torch.testing.assert_close(final, ref_state, **TOL)
        rec_out, rec_state = reference(q, k, v, g, beta, init, recurrent=True)
        torch.testing.assert_close(out, rec_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, rec_state, atol=1e-4, rtol=1e-4)


def test_span_split_in_two_calls_equals_one_call():
    q, k, v, g, beta = inputs(150)
    out, final, _ = chunk_gated_delta(q, k, v, g, beta, None)
    cut = 70
    first, mid, _ = chunk_gated_delta(*(x[:cut] for x in (q, k, v, g, beta)), None)
    second, end, _ = chunk_gated_delta(*(x[cut:] for x in (q, k, v, g, beta)), mid)
    torch.testing.assert_close(torch.cat([first, second]), out, **TOL)
    torch.testing.assert_close(end, final, **TOL)


def test_checkpoint_states_equal_a_call_that_stops_there():
    q, k, v, g, beta = inputs(150)
    init = torch.randn(4, 16, 8) * 0.3
    offsets = [1, 16, 63, 64, 65, 128, 150]
    _, final, states = chunk_gated_delta(q, k, v, g, beta, init, offsets)
    for n, state in zip(offsets, states):
        _, stop = reference(*(x[:n] for x in (q, k, v, g, beta)), init)
        torch.testing.assert_close(state, stop, **TOL)
    torch.testing.assert_close(states[-1], final, **TOL)
    with pytest.raises(ValueError):
        chunk_gated_delta(q, k, v, g, beta, init, [0])


def test_one_step_batched_matches_transformers_recurrence():
    q, k, v, g, beta = inputs(1, batch=3)
    state = torch.randn(3, 4, 16, 8) * 0.3
    out, new = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    ref_out, ref_state = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref_out[:, 0], **TOL)
    torch.testing.assert_close(new, ref_state, **TOL)


def test_decode_steps_continue_a_chunked_prefill():
    q, k, v, g, beta = inputs(20)
    _, state, _ = chunk_gated_delta(*(x[:17] for x in (q, k, v, g, beta)), None)
    outs = []
    for t in range(17, 20):
        o, state = gated_delta_step(*(x[t : t + 1] for x in (q, k, v, g, beta)), state.unsqueeze(0))
        state = state[0]
        outs.append(o)
    ref_out, ref_state = reference(q, k, v, g, beta)
    torch.testing.assert_close(torch.cat(outs), ref_out[17:], **TOL)
    torch.testing.assert_close(state, ref_state, **TOL)


def test_causal_conv_with_carried_state():
    C, K, T = 12, 4, 9
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    ref = causal_conv1d_fn(x.t().unsqueeze(0), w, None, activation="silu")[0].t()
    out, window = causal_conv(x, w, torch.zeros(C, K - 1))
    torch.testing.assert_close(out, ref, **TOL)
    # in two pieces, the state being the last K-1 inputs
    a, win_a = causal_conv(x[:5], w, torch.zeros(C, K - 1))
    b, _ = causal_conv(x[5:], w, win_a[:, 5 : 5 + K - 1])
    torch.testing.assert_close(torch.cat([a, b]), ref, **TOL)
    torch.testing.assert_close(window[:, 5 : 5 + K - 1], win_a[:, -(K - 1):])
    # one step per sequence, batched: as transformers' update
    states = torch.randn(2, C, K - 1, generator=gen)
    ref_states = states.clone()
    step, new = causal_conv_step(x[:2], w, states)
    ref_step = causal_conv1d_update(x[:2].unsqueeze(-1), ref_states, w, None, "silu")[..., 0]
    torch.testing.assert_close(step, ref_step, **TOL)
    torch.testing.assert_close(new, ref_states)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_chunked_rule_on_cuda():
    q, k, v, g, beta = inputs(100)
    out, final, _ = chunk_gated_delta(q, k, v, g, beta, None)
    cu = chunk_gated_delta(*(x.cuda() for x in (q, k, v, g, beta)), None, [50])
    torch.testing.assert_close(cu[0].cpu(), out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cu[1].cpu(), final, atol=1e-4, rtol=1e-4)
