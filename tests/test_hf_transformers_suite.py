"""transformers' own generic model tests (``ModelTesterMixin``) run against MegalodonForCausalLM.

The mixin is transformers' code, not ours: it is read at test time from the transformers sdist
of the installed version (``pip download --no-deps --no-binary :all: transformers==X``, kept in a
cache directory: ``$MEGALODON_HF_SDIST_DIR``, default ``~/.cache/megalodon-kernels/hf-sdist``);
nothing of it is copied into this repository. Where it cannot be had (no network, no pip) the
module skips with the reason.

The only skips are those transformers makes for its own recurrent Mamba model
(tests/models/mamba/test_modeling_mamba.py), each listed in ``MAMBA_SKIPS`` with its reason.
Two modules of transformers' test tree that the mixin imports are not in the sdist: the export
mixin (``tests/exporters``; its torch.export tests are not run here) and the generation mixin
(``tests/generation``, GenerationTesterMixin): our own generation checks take its place
(:class:`GenerationChecks`), written for a recurrent cache.

The whole mixin runs by default (about 10-40 s on two cores).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # the mixin's hub helpers must not reach the network

import importlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import types  # noqa: E402
import unittest  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

pytestmark = pytest.mark.usefixtures("one_thread")

from megalodon_kernels.model.hf import (  # noqa: E402
    CACHE_ARG, MegalodonForCausalLM, MegalodonHFCache, MegalodonHFConfig)

#: The package name the sdist's tests/ folder is imported under.
_PKG = "_megalodon_hf_suite"
#: Files of the sdist's tests/ folder the mixin needs.
_FILES = ("test_modeling_common.py",)


def _sdist_tests_dir() -> Path:
    """The tests/ folder of the installed transformers' sdist, downloaded once into the cache."""
    version = transformers.__version__
    root = Path(os.environ.get("MEGALODON_HF_SDIST_DIR", Path.home() / ".cache" / "megalodon-kernels" / "hf-sdist"))
    out = root / f"transformers-{version}" / "tests"
    if all((out / f).is_file() for f in _FILES):
        return out
    root.mkdir(parents=True, exist_ok=True)
    tarball = root / f"transformers-{version}.tar.gz"
    if not tarball.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--timeout", "20",
               "--retries", "1", "-d", str(root), f"transformers=={version}"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"`{' '.join(cmd)}` did not finish: {e}") from e
        if run.returncode != 0 or not tarball.is_file():
            tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"`pip download` of the transformers {version} sdist failed: {tail[0]}")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        for f in _FILES:
            text = tar.extractfile(f"transformers-{version}/tests/{f}").read()
            part = out / f"{f}.{os.getpid()}.part"  # then renamed: a concurrent run never reads half a file
            part.write_bytes(text)
            part.replace(out / f)
    return out


class GenerationChecks:
    """Stands in for transformers' GenerationTesterMixin (not in the sdist): ``generate`` checks of
    our own, for a model whose cache is a recurrent state (the mixin checks the class is one)."""

    def _generate_model(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        torch.manual_seed(0)
        return MegalodonForCausalLM(config).eval(), inputs["input_ids"]

    def test_generate_greedy_matches_native(self):
        model, ids = self._generate_model()
        eos = model.config.eos_token_id  # also the pad id: finished rows repeat it in both
        got = model.generate(ids, max_new_tokens=5, do_sample=False)
        self.assertTrue(torch.equal(got, model.megalodon.generate(ids, 5, greedy=True, eos_token_id=eos)))

    def test_generate_without_cache_matches(self):
        model, ids = self._generate_model()
        with_cache = model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3)
        without = model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3, use_cache=False)
        self.assertTrue(torch.equal(with_cache, without))

    def test_generate_dict_outputs(self):
        model, ids = self._generate_model()
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                             output_scores=True, output_logits=True, output_hidden_states=True)
        B, L = ids.shape
        self.assertEqual(out.sequences.shape, (B, L + 3))
        self.assertEqual(len(out.scores), 3)
        self.assertEqual(len(out.logits), 3)
        self.assertIsInstance(getattr(out, CACHE_ARG), MegalodonHFCache)
        self.assertEqual(len(out.hidden_states), 3)
        n = model.config.num_layers + 1
        self.assertEqual([len(h) for h in out.hidden_states], [n] * 3)
        self.assertEqual(out.hidden_states[0][0].shape, (B, L, model.config.model_dim))
        self.assertEqual(out.hidden_states[1][0].shape, (B, 1, model.config.model_dim))

    def test_generate_from_inputs_embeds(self):
        model, ids = self._generate_model()
        embeds = model.get_input_embeddings()(ids)
        got = model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False)
        # transformers returns only the new tokens when the prompt came as embeddings
        want = model.megalodon.generate(ids, 4, greedy=True, eos_token_id=model.config.eos_token_id)[:, ids.shape[1]:]
        self.assertTrue(torch.equal(got, want))

    def test_generate_beam_search_runs(self):
        model, ids = self._generate_model()
        out = model.generate(ids, max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False)
        self.assertEqual(out.shape, (2 * ids.shape[0], ids.shape[1] + 3))

    def test_left_padding_generates_each_row_as_alone(self):
        model, ids = self._generate_model()
        eos = model.config.eos_token_id
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        padded = ids.masked_fill(mask == 0, model.config.pad_token_id)
        got = model.generate(padded, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        for b in range(ids.shape[0]):
            row = ids[b:b + 1, int((mask[b] == 0).sum()):]
            alone = model.generate(row, max_new_tokens=3, min_new_tokens=3, do_sample=False)
            self.assertTrue(torch.equal(got[b, -3:], alone[0, -3:]), f"row {b} (eos {eos})")

    def test_generate_continues_from_the_returned_cache(self):
        model, ids = self._generate_model()
        whole = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        first = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        # transformers' way: the whole sequence and its mask with the cache
        more = model.generate(first.sequences, attention_mask=torch.ones_like(first.sequences), max_new_tokens=2,
                              min_new_tokens=2, do_sample=False, **{CACHE_ARG: getattr(first, CACHE_ARG)})
        self.assertTrue(torch.equal(more, whole))

    def test_assisted_decoding_is_refused(self):
        model, ids = self._generate_model()
        with self.assertRaisesRegex(ValueError, "stateful"):
            model.generate(ids, max_new_tokens=3, prompt_lookup_num_tokens=2)


class MegalodonModelTester:
    """A tiny config and inputs, the interface ModelTesterMixin reads (as its model testers have)."""

    def __init__(self, parent, batch_size=3, seq_length=7, vocab_size=99):
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.is_training = True
        self.num_hidden_layers = 2
        self.hidden_size = 32
        self.num_attention_heads = 2
        self.pad_token_id = self.eos_token_id = self.bos_token_id = vocab_size - 1

    def get_config(self):
        return MegalodonHFConfig(num_layers=self.num_hidden_layers, model_dim=self.hidden_size, z_dim=16,
                                 value_dim=32, num_heads=self.num_attention_heads, ffn_hidden_dim=64, cema_ndim=4,
                                 chunk_size=4, norm_num_groups=4, vocab_size=self.vocab_size,
                                 eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                                 bos_token_id=self.bos_token_id)

    def prepare_config_and_inputs_for_common(self):
        g = torch.Generator().manual_seed(7)
        # ids below the pad id: a pad id inside a prompt is a question of its own (tests/test_hf.py)
        ids = torch.randint(0, self.vocab_size - 1, (self.batch_size, self.seq_length), generator=g)
        return self.get_config(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


#: The tests transformers skips for Mamba (tests/models/mamba/test_modeling_mamba.py), with its reasons;
#: its class attributes has_attentions = False and test_missing_keys = False are set below as there.
MAMBA_SKIPS = {
    "test_multi_gpu_data_parallel_forward": "Mamba models do not support DDP (transformers' skip for Mamba); "
                                            "the recurrent cache is not split by DataParallel",
}

#: Beyond Mamba's: one test whose own docstring invites a skip for an architecture it does not fit.
OWN_SKIPS = {
    "test_model_base_model_prefix": "MegalodonForCausalLM is one flat module tree with upstream's names at the top "
                                    "level (embed.weight, layers.0..., output.output.weight) so that its state dict "
                                    "is an upstream checkpoint's; it has no base-model attribute to find (the "
                                    "mixin's docstring: 'Feel free to skip the test in that case')",
}


def _register_marks(source: str) -> None:
    """Register the pytest marks the mixin's source applies (this suite runs with --strict-markers;
    the marks are transformers' own and select nothing here). The config is reached through
    pytest.mark, the one place a test module sees it at import time."""
    config = getattr(pytest.mark, "_config", None)
    if config is None:
        return
    known = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name in sorted(set(re.findall(r"\bmark\.([A-Za-z_]\w*)", source)) - known):
        config.addinivalue_line("markers", f"{name}: a mark of transformers' test suite (tests/{Path(__file__).name})")


def _load_mixin(tests_dir: Path):
    import transformers.testing_utils as testing_utils  # its decorators apply marks too

    _register_marks("".join((tests_dir / f).read_text() for f in _FILES) + Path(testing_utils.__file__).read_text())
    pkg = types.ModuleType(_PKG)
    pkg.__path__ = [str(tests_dir)]
    sys.modules[_PKG] = pkg
    export = types.ModuleType(f"{_PKG}.exporters.test_export")

    class ExportTesterMixin:  # tests/exporters is not in the sdist: its export tests are not run here
        pass

    export.ExportTesterMixin = ExportTesterMixin
    gen = types.ModuleType(f"{_PKG}.generation.test_utils")
    gen.GenerationTesterMixin = GenerationChecks
    for name, mod in ((f"{_PKG}.exporters", types.ModuleType(f"{_PKG}.exporters")),
                      (f"{_PKG}.generation", types.ModuleType(f"{_PKG}.generation")),
                      (export.__name__, export), (gen.__name__, gen)):
        mod.__path__ = []
        sys.modules[name] = mod
    return importlib.import_module(f"{_PKG}.test_modeling_common")


try:
    _tests_dir = _sdist_tests_dir()
except (RuntimeError, OSError, tarfile.TarError, KeyError) as e:  # no network, no pip, a broken download
    pytest.skip(f"transformers' test mixin could not be obtained: {e}", allow_module_level=True)
_common = _load_mixin(_tests_dir)  # an import error here is a failure: the sdist is there

from transformers.models.auto import modeling_auto  # noqa: E402


class MegalodonTransformersSuite(_common.ModelTesterMixin, GenerationChecks, unittest.TestCase):
    all_model_classes = (MegalodonForCausalLM,)
    has_attentions = False  # as Mamba: no attention weights to output
    test_missing_keys = False  # as Mamba
    # The mixin skips this init check for models whose file has no copyright year >= 2023 (ours has
    # none); Mamba's (2024) runs it, so ours does.
    test_can_init_all_missing_weights_before_2023 = True

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # An in-tree model is listed in transformers' causal-LM names, by which the mixin picks its
        # checks (labels, shift_labels); listed while this class runs.
        names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        cls._listed = "megalodon" not in names
        names.setdefault("megalodon", "MegalodonForCausalLM")

    @classmethod
    def tearDownClass(cls):
        if cls._listed:
            del modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["megalodon"]
        super().tearDownClass()

    def setUp(self):
        self.model_tester = MegalodonModelTester(self)


for _name, _reason in {**MAMBA_SKIPS, **OWN_SKIPS}.items():
    setattr(MegalodonTransformersSuite, _name, unittest.skip(_reason)(lambda self: None))
