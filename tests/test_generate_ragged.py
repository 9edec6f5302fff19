"""Ragged batches: prompts of different lengths prefilled packed and decoded together give, row by
row, what generating each prompt alone gives (greedy: the same tokens; logits within 1e-5 fp32),
whatever the other rows hold; per-row eos / max_new_tokens / generators; bad input refused.
"""
import pytest
import torch

from megalodon_kernels.model import Megalodon, MegalodonConfig
from support import perturb_

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread

C = 8
V = 41
# crossing chunk boundaries at different places: 1 token, exactly one chunk, several chunks + a bit
LENGTHS = [5, 1, 8, 19, 3, 12]


def make_model(dtype=torch.float32, seed=0, **kw):
    cfg = dict(num_layers=2, model_dim=24, z_dim=16, value_dim=20, num_heads=2, ffn_hidden_dim=40, cema_ndim=4,
               chunk_size=C, norm_num_groups=4, vocab_size=V, backend="torch", norm_prior_count=2)
    cfg.update(kw)
    torch.manual_seed(seed)
    return perturb_(Megalodon(MegalodonConfig(**cfg)).to(dtype).eval(), seed + 100, 0.2)


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def model():
    return make_model()


@torch.no_grad()
def test_ragged_greedy_equals_each_prompt_alone(model):
    prompts = prompts_of(LENGTHS)
    new = 13  # crosses a chunk boundary in every row
    out, logits = model.generate(prompts, new, greedy=True, return_logits=True)
    assert isinstance(out, list) and len(out) == len(prompts)
    for p, o, lg in zip(prompts, out, logits):
        alone = model.generate(p[None], new, greedy=True)[0]
        assert torch.equal(o, alone), (o, alone)
        # the logits each token was chosen from = a full forward over the row alone
        full = model(o[None])[0, p.shape[0] - 1:-1]
        err = rel_err(lg, full)
        print(f"L0={p.shape[0]}: logits relative error {err:.1e}")
        assert lg.shape == (new, V) and err < 1e-5


@torch.no_grad()
def test_row_does_not_depend_on_the_other_rows(model):
    """The same prompt among other prompts of other lengths: same tokens and logits."""
    target = prompts_of([11], seed=7)[0]
    ref, ref_logits = model.generate([target], 10, greedy=True, return_logits=True)
    for others in ([1], [30, 2], [8, 8, 8, 16]):
        batch = prompts_of(others, seed=len(others)) + [target]
        out, logits = model.generate(batch, 10, greedy=True, return_logits=True)
        assert torch.equal(out[-1], ref[0])
        assert rel_err(logits[-1], ref_logits[0]) < 1e-5


@torch.no_grad()
def test_left_padded_mask_and_lengths_equal_the_list(model):
    prompts = prompts_of([4, 9, 1])
    L = 9
    padded = torch.full((3, L), 7, dtype=torch.long)  # padding value is never read
    mask = torch.zeros(3, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, L - p.shape[0]:] = p
        mask[b, L - p.shape[0]:] = 1
    ref = model.generate(prompts, 6, greedy=True)
    out = model.generate(padded, 6, attention_mask=mask, greedy=True)
    assert out.shape == (3, L + 6) and torch.equal(out[:, :L], padded)
    for b in range(3):
        assert torch.equal(out[b, L - prompts[b].shape[0]:], ref[b])
    assert torch.equal(model.generate(padded, 6, lengths=[4, 9, 1], greedy=True), out)
    assert torch.equal(model.generate(padded, 6, lengths=torch.tensor([4, 9, 1]), greedy=True), out)


@torch.no_grad()
def test_per_row_eos_max_new_tokens_and_padding(model):
    prompts = prompts_of([6, 2, 10])
    free = model.generate(prompts, 8, greedy=True)
    eos1 = int(free[1][2 + 3])  # row 1's 4th new token
    first = int((free[1][2:] == eos1).nonzero()[0])
    out = model.generate(prompts, [8, 8, 2], greedy=True, eos_token_id=[None, eos1, None])
    assert torch.equal(out[0], free[0])
    assert torch.equal(out[1], free[1][:2 + first + 1])  # stops at its eos, inclusive
    assert torch.equal(out[2], free[2][:10 + 2])  # its own max_new_tokens
    # padded form: rows that end early are filled with pad_token_id
    padded = torch.zeros(3, 10, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, 10 - p.shape[0]:] = p
    res = model.generate(padded, [8, 8, 2], lengths=[6, 2, 10], greedy=True, eos_token_id=[None, eos1, None],
                         pad_token_id=-1)
    assert res.shape == (3, 18)
    assert torch.equal(res[2, 12:], torch.full((6,), -1))
    assert torch.equal(res[1, 10:10 + first + 1], free[1][2:2 + first + 1])
    # max_new_tokens 0 for a row: just its prompt
    assert torch.equal(model.generate(prompts, [0, 3, 0], greedy=True)[0], prompts[0])


@torch.no_grad()
def test_per_row_generators_reproduce_each_row_alone(model):
    prompts = prompts_of([3, 14])
    gens = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]
    out = model.generate(prompts, 9, temperature=0.9, top_k=5, generator=gens)
    for p, o, seed in zip(prompts, out, (11, 12)):
        alone = model.generate([p], 9, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(o, alone[0])


@torch.no_grad()
def test_prefill_rows_equal_streaming_each_prompt(model):
    """model.prefill's cache rows hold the state a plain streaming call leaves (same tensors)."""
    prompts = prompts_of(LENGTHS)
    cache, last = model.prefill(prompts)
    assert cache.lengths.tolist() == LENGTHS
    for b, p in enumerate(prompts):
        alone = model.init_cache(1)
        logits = model(p[None], cache=alone)
        assert rel_err(last[b], logits[0, -1]) < 1e-5
        row = cache.select([b])
        for mine, ref in zip(row.tensors(), alone.tensors()):
            live = mine
            if mine.dim() == 4 and mine.shape[1] == C:  # k, v: compare the live slots only
                n = p.shape[0] % C
                live, ref = mine[:, :n], ref[:, :n]
            assert torch.allclose(live, ref, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused(model):
    p = prompts_of([3, 4])
    with pytest.raises(ValueError, match=r"prompt\[1\] is empty"):
        model.generate([p[0], p[1][:0]], 2)
    with pytest.raises(ValueError, match="at least one prompt"):
        model.generate([], 2)
    with pytest.raises(TypeError, match=r"prompt\[0\]"):
        model.generate([p[0].float()], 2)
    padded = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask must be a tensor of the prompt's shape"):
        model.generate(padded, 2, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="attention_mask row 0 is not left-padded"):
        model.generate(padded, 2, attention_mask=torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask must hold only 0"):
        model.generate(padded, 2, attention_mask=torch.full((2, 4), 2))
    with pytest.raises(ValueError, match=r"prompt\[1\] is empty"):
        model.generate(padded, 2, attention_mask=torch.tensor([[0, 1, 1, 1], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="lengths must hold 2 ints"):
        model.generate(padded, 2, lengths=[1, 5])
    with pytest.raises(ValueError, match="either attention_mask or lengths"):
        model.generate(padded, 2, lengths=[1, 2], attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="max_new_tokens has 3 entries for 2 prompts"):
        model.generate(p, [1, 2, 3])
    with pytest.raises(ValueError, match="max_new_tokens must be ints >= 0"):
        model.generate(p, [1, -2])
    with pytest.raises(TypeError, match="eos_token_id"):
        model.generate(p, 2, eos_token_id="2")
    with pytest.raises(TypeError, match="generator"):
        model.generate(p, 2, generator=[1, 2])
    with pytest.raises(ValueError, match="prefill_size is for a rectangular prompt"):
        model.generate(p, 2, prefill_size=2)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        model.decode(torch.zeros(2, 1, dtype=torch.long), model.init_cache(2))


@torch.no_grad()
def test_serving_example_loop_equals_each_request_alone(model):
    """examples/serve_batch.py's loop (rows join and leave) on a small queue."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "serve_batch.py"
    spec = importlib.util.spec_from_file_location("serve_batch", path)
    serve_batch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_batch)
    g = torch.Generator().manual_seed(9)
    requests = [(torch.randint(0, V, (int(n),), generator=g), int(m))
                for n, m in zip(torch.randint(1, 20, (7,), generator=g), torch.randint(1, 9, (7,), generator=g))]
    eos = 3
    out, steps = serve_batch.serve(model, requests, max_batch=3, eos=eos)
    assert steps > 0
    for i, (prompt, budget) in enumerate(requests):
        alone = model.generate(prompt[None], budget, greedy=True, eos_token_id=eos)[0, prompt.shape[0]:]
        assert out[i] == alone.tolist()
