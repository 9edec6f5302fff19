"""MegalodonCache row operations (select / reorder / drop / cat / write_rows_): after any sequence of
them, every row decodes exactly as its sequence would alone; a row index out of range and a cache
of another model are refused, naming the argument.
"""
import pytest
import torch

from megalodon_kernels.model import Megalodon, MegalodonCache, MegalodonConfig
from support import perturb_

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread

C = 8
V = 41


def make_model(seed=0, **kw):
    cfg = dict(num_layers=2, model_dim=24, z_dim=16, value_dim=20, num_heads=2, ffn_hidden_dim=40, cema_ndim=4,
               chunk_size=C, norm_num_groups=4, vocab_size=V, backend="torch")
    cfg.update(kw)
    torch.manual_seed(seed)
    return perturb_(Megalodon(MegalodonConfig(**cfg)).eval(), seed + 100, 0.2)


@pytest.fixture(scope="module")
def model():
    return make_model()


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


class Alone:
    """Each sequence's reference: its own batch-1 cache, fed the same tokens."""

    def __init__(self, model, prompt):
        self.model, self.cache = model, model.init_cache(1)
        self.logits = model(prompt[None], cache=self.cache)[0, -1]

    def step(self, token):
        self.logits = self.model(torch.tensor([[token]]), cache=self.cache)[0, -1]
        return self.logits


@torch.no_grad()
def test_rows_join_leave_and_reorder_like_running_alone(model):
    """A server-like schedule: prefill 3, decode, one leaves, 2 join from a new prefill, reorder,
    drop, duplicate a row, decode again; each row tracks its own reference the whole way."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (5, 11, 2, 17, 9)]
    refs = [Alone(model, p) for p in prompts]
    cache, logits = model.prefill(prompts[:3])
    rows = [0, 1, 2]  # which reference each cache row follows

    def decode(n):
        nonlocal logits
        for _ in range(n):
            tok = logits.argmax(-1)
            logits = model.decode(tok, cache)
            for i, r in enumerate(rows):
                expect = refs[r].step(int(tok[i]))
                assert rel_err(logits[i], expect) < 1e-5

    def check_logits():
        for i, r in enumerate(rows):
            assert rel_err(logits[i], refs[r].logits) < 1e-5

    decode(6)
    cache, logits, rows = cache.drop([1]), logits[[0, 2]], [0, 2]       # row 1 finished
    new, new_logits = model.prefill(prompts[3:])                          # two join
    cache, logits, rows = MegalodonCache.cat([cache, new]), torch.cat([logits, new_logits]), rows + [3, 4]
    check_logits()
    decode(5)
    order = [3, 0, 2, 1]
    cache, logits, rows = cache.select(order), logits[order], [rows[i] for i in order]
    check_logits()
    decode(4)
    keep = torch.tensor([True, False, True, True])
    cache, logits, rows = cache.select(keep), logits[keep], [r for r, k in zip(rows, keep) if k]
    decode(3)
    assert cache.batch_size == 3 and cache.lengths.tolist() == [refs[r].cache.num_tokens for r in rows]
    # branching: the same row twice; both copies continue as the row alone would
    twin = cache.select([1, 1])
    a = model.decode(torch.tensor([5, 5]), twin)
    expect = refs[rows[1]].step(5)
    assert rel_err(a[0], expect) < 1e-5 and rel_err(a[1], expect) < 1e-5


@torch.no_grad()
def test_write_rows_in_place_keeps_storage_and_equals_alone(model):
    """A fixed-size batch (a compiled / graph-captured step needs it): a finished row's slot is
    overwritten by a new prefill's row in place; the tensors keep their storage."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (7, 3, 12)]
    cache, logits = model.prefill(prompts[:2])
    ptrs = [t.data_ptr() for t in cache.tensors()]
    for _ in range(4):
        logits = model.decode(logits.argmax(-1), cache)
    new, new_logits = model.prefill(prompts[2:])
    cache.write_rows_([0], new)
    assert [t.data_ptr() for t in cache.tensors()] == ptrs
    ref = Alone(model, prompts[2])
    tok = new_logits.argmax(-1)
    for _ in range(10):  # crosses chunk boundaries in the new row
        logits = model.decode(torch.cat([tok, logits[1:].argmax(-1)]), cache)
        assert rel_err(logits[0], ref.step(int(tok[0]))) < 1e-5
        tok = logits[:1].argmax(-1)
    # source_rows picks rows of the source
    other, _ = model.prefill(prompts)
    cache.write_rows_(torch.tensor([1, 0]), other, source_rows=[2, 0])
    assert cache.lengths.tolist() == [7, 12]


def test_bad_rows_and_foreign_caches_are_refused(model):
    cache = model.init_cache(3)
    with pytest.raises(IndexError, match="rows holds row index 3, out of range for a cache of 3 rows"):
        cache.select([0, 3])
    with pytest.raises(IndexError, match="rows holds row index -1"):
        cache.drop([-1])
    with pytest.raises(TypeError, match="rows must hold integer"):
        cache.select(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="boolean mask must have shape"):
        cache.select(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="rows must be a sequence of ints"):
        cache.select(["a"])
    with pytest.raises(IndexError, match="source_rows holds row index 5"):
        cache.write_rows_([0], model.init_cache(2), source_rows=[5])
    with pytest.raises(ValueError, match="rows has 2 entries but source_rows 1"):
        cache.write_rows_([0, 1], model.init_cache(2), source_rows=[1])
    other = make_model(num_heads=4, z_dim=16, value_dim=20)
    foreign = other.init_cache(3)
    with pytest.raises(ValueError, match="source is a cache of another model"):
        cache.write_rows_([0], foreign)
    with pytest.raises(ValueError, match=r"caches\[1\] is a cache of another model"):
        MegalodonCache.cat([cache, foreign])
    with pytest.raises(ValueError, match="cache is not a cache of this model"):
        model(torch.zeros(3, 2, dtype=torch.long), cache=foreign)
    with pytest.raises(ValueError, match="cache is not a cache of this model"):
        model.decode(torch.zeros(3, dtype=torch.long), make_model(chunk_size=4).init_cache(3))
    with pytest.raises(ValueError, match="cache was made for batch 3 but the tokens bring 2"):
        model.decode(torch.zeros(2, dtype=torch.long), cache)
    with pytest.raises(TypeError, match="cache must be a MegalodonCache"):
        model.decode(torch.zeros(2, dtype=torch.long), {})
    started = model.init_cache(2)
    model(torch.zeros(2, 3, dtype=torch.long), cache=started)
    with pytest.raises(ValueError, match="needs fresh rows"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=started, cu_seqlens=torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="cache is not a cache of this model"):
        model.decode(torch.zeros(2, dtype=torch.long), make_model().double().init_cache(2))
