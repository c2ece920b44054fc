"""sample(): greedy, temperature (empirical distribution), top-p nucleus, mixed rows;
SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from compiled_attn.sampling import SamplingParams, exponential_noise, sample


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seed: int) -> torch.Tensor:
    """sample() with every row of request ``seed`` at its own position (fresh noise per row)."""
    rows = logits.shape[0]
    return sample(logits, temperature, top_p, torch.full((rows,), seed), torch.arange(rows))


def full(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float32)


def counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double()


def assert_frequencies(tokens: torch.Tensor, probs: torch.Tensor, sigmas: float = 5.0) -> None:
    """Each token's empirical frequency within ``sigmas`` standard errors of ``probs``."""
    n = tokens.numel()
    freq = counts(tokens, probs.numel()) / n
    p = probs.double()
    se = torch.sqrt(p * (1 - p) / n).clamp_min(1e-12)
    z = (freq - p).abs() / se
    assert (z < sigmas).all(), f"freq {freq.tolist()} vs p {p.tolist()} (z {z.tolist()})"


def test_greedy_is_argmax_and_ignores_top_p_and_seed():
    torch.manual_seed(0)
    logits = torch.randn(32, 50)
    for top_p in (1.0, 0.3, 1e-6):
        out = draw(logits, full(32, 0.0), full(32, top_p), 1)
        assert out.dtype == torch.int64 and out.shape == (32,)
        assert torch.equal(out, logits.argmax(-1))
    assert torch.equal(draw(logits, full(32, 0.0), full(32, 1.0), 2), logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    torch.manual_seed(0)
    logits = torch.randn(64, 40) * 0.5
    t, p = full(64, 1.0), full(64, 1.0)
    a = draw(logits, t, p, 123)
    b = draw(logits, t, p, 123)
    c = draw(logits, t, p, 124)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # Flat-ish logits at T=1 are not greedy: many rows differ from the argmax.
    assert (a != logits.argmax(-1)).sum() > 16


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.5])
def test_empirical_frequencies_match_softmax_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.7])
    n = 20000
    tokens = draw(logits.expand(n, -1).contiguous(), full(n, temperature), full(n, 1.0), 7)
    assert_frequencies(tokens, torch.softmax(logits.double() / temperature, -1))


def test_temperature_changes_the_distribution():
    # A wrong temperature (e.g. ignored) would fail the check against T=1 probabilities.
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.7])
    n = 20000
    tokens = draw(logits.expand(n, -1).contiguous(), full(n, 0.5), full(n, 1.0), 8)
    freq = counts(tokens, 5) / n
    p_t1 = torch.softmax(logits.double(), -1)
    assert (freq - p_t1).abs().max() > 0.05


def nucleus_logits():
    # probabilities 0.4, 0.3, 0.15, 0.1, 0.05 placed at shuffled positions
    probs = torch.tensor([0.1, 0.3, 0.05, 0.4, 0.15], dtype=torch.float64)
    return probs.log().float(), probs


def test_top_p_keeps_exactly_the_nucleus():
    logits, probs = nucleus_logits()
    n = 20000
    # top_p 0.75: 0.4 + 0.3 = 0.7 < 0.75, so the 0.15 token is needed; 0.85 >= 0.75 stops.
    tokens = draw(logits.expand(n, -1).contiguous(), full(n, 1.0), full(n, 0.75), 11)
    hist = counts(tokens, 5)
    nucleus = [3, 1, 4]
    assert hist[0] == 0 and hist[2] == 0, hist.tolist()
    assert (hist[nucleus] > 0).all()
    kept = torch.zeros(5, dtype=torch.float64)
    kept[nucleus] = probs[nucleus]
    assert_frequencies(tokens, kept / kept.sum())


@pytest.mark.parametrize("top_p, allowed", [(0.35, [3]), (0.5, [3, 1]), (0.69, [3, 1]), (0.9, [3, 1, 4, 0])])
def test_top_p_support(top_p, allowed):
    logits, _ = nucleus_logits()
    n = 4000
    tokens = draw(logits.expand(n, -1).contiguous(), full(n, 1.0), full(n, top_p), 5)
    assert set(tokens.tolist()) == set(allowed)


def test_tiny_top_p_always_allows_the_top_token():
    torch.manual_seed(3)
    logits = torch.randn(256, 30)
    tokens = draw(logits, full(256, 1.5), full(256, 1e-6), 0)
    assert torch.equal(tokens, logits.argmax(-1))
    # Even when the top token is far from dominant (flat distribution, ties broken somehow).
    flat = torch.zeros(8, 10)
    flat[:, 6] = 1e-3
    assert draw(flat, full(8, 1.0), full(8, 1e-6), 0).tolist() == [6] * 8


def test_top_p_one_can_sample_every_token():
    logits = torch.zeros(5)
    n = 5000
    tokens = draw(logits.expand(n, -1).contiguous(), full(n, 1.0), full(n, 1.0), 2)
    assert set(tokens.tolist()) == {0, 1, 2, 3, 4}
    assert_frequencies(tokens, torch.full((5,), 0.2, dtype=torch.float64))


def test_mixed_per_row_temperatures_and_top_p():
    torch.manual_seed(1)
    base = torch.randn(20) * 0.3
    rows = 400
    logits = base.expand(rows, -1).contiguous()
    temperature = torch.tensor([0.0, 1.0, 0.0, 2.0] * (rows // 4))
    top_p = torch.tensor([1.0, 1.0, 0.5, 1e-6] * (rows // 4))
    out = draw(logits, temperature, top_p, 9)
    argmax = int(base.argmax())
    assert (out[0::4] == argmax).all()  # greedy
    assert (out[2::4] == argmax).all()  # greedy, top_p irrelevant
    assert (out[3::4] == argmax).all()  # sampled but nucleus of one token
    assert len(set(out[1::4].tolist())) > 5  # sampled, flat-ish: many tokens
    # Greedy rows do not depend on the random stream.
    out2 = draw(logits, temperature, top_p, 10)
    assert torch.equal(out[0::2], out2[0::2])


def test_per_row_distributions_are_independent():
    # Row 0 always prefers token 0, row 1 token 4; each row sampled from its own logits.
    n = 4000
    logits = torch.tensor([[5.0, 0, 0, 0, 0], [0, 0, 0, 0, 5.0]]).repeat(n, 1)
    out = draw(logits, full(2 * n, 1.0), full(2 * n, 1.0), 4)
    p = math.exp(5) / (math.exp(5) + 4)
    assert_frequencies(out[0::2], torch.tensor([p] + [(1 - p) / 4] * 4, dtype=torch.float64))
    assert_frequencies(out[1::2], torch.tensor([(1 - p) / 4] * 4 + [p], dtype=torch.float64))


def test_sampling_params_defaults_and_validation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.max_new_tokens) == (0.0, 1.0, 32)
    SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature.*-0.5"):
        SamplingParams(temperature=-0.5)
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens"):
            SamplingParams(max_new_tokens=bad)
    with pytest.raises(Exception):
        p.temperature = 1.0  # frozen


def test_noise_depends_only_on_seed_position_and_token():
    """A row's draw is the same alone or in a batch, and changes with seed or position."""
    seeds, positions = torch.tensor([5, 5, 6, 5]), torch.tensor([10, 11, 10, 10])
    noise = exponential_noise(seeds, positions, 1000)
    assert torch.equal(noise[0], noise[3])
    assert torch.equal(exponential_noise(seeds[1:2], positions[1:2], 1000)[0], noise[1])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e, over 4000 draws.
    flat = noise.flatten().double()
    assert abs(flat.mean().item() - 1) < 0.05 and abs(flat.var().item() - 1) < 0.1
    assert abs((flat > 1).double().mean().item() - math.exp(-1)) < 0.02
    assert noise.dtype == torch.float32 and torch.isfinite(noise).all() and (noise > 0).all()
