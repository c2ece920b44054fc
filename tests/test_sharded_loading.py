"""Sharded loading (issue 14 item 2): ``load_diffllama(dir, tp=...)`` reads only the rank's
slices of a Hugging Face checkpoint (``safe_open(...).get_slice``) and gives, tensor for
tensor, what ``shard_model(load_diffllama(dir), tp)`` gives, for a GQA and an MHA config
(the MHA one with KV sharing, biases, affine subln and tied embeddings), on both ranks of a
world of two; ``TensorParallel`` objects are built without a process group (loading runs no
collective)."""

from __future__ import annotations

import pytest
import torch

from compiled_attn.distributed import TensorParallel
from compiled_attn.models import build_random_model, load_diffllama, save_diffllama
from compiled_attn.models import loader
from compiled_attn.models.sharding import shard_model

from test_tensor_parallel import GQA, MHA  # the same two configs

WORLD = 2
SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")


def _save(config, directory, dtype=None):
    model = build_random_model(config, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random biases and subln weights (the builder zeroes / ones them)
        for name, param in model.named_parameters():
            if name.endswith("bias") or "subln" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02 + ("subln" in name))
    return save_diffllama(model, directory, dtype=dtype)


class _Recorder:
    """Wraps ``safe_open``: counts the bytes each Hugging Face tensor yields."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def open(self, *args, **kwargs):
        recorder, handle = self, _real_safe_open(*args, **kwargs)

        class Slice:
            def __init__(self, name):
                self.name, self.inner = name, handle.get_slice(name)

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                tensor = self.inner[index]
                recorder.bytes[self.name] = recorder.bytes.get(self.name, 0) + tensor.numel() * tensor.element_size()
                return tensor

        class Handle:
            def keys(self):
                return handle.keys()

            def get_slice(self, name):
                return Slice(name)

            def get_tensor(self, name):
                return Slice(name)[:]

        return Handle()


_real_safe_open = loader.safe_open


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype,file_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.float32, torch.bfloat16)])
def test_sharded_load_equals_shard_of_full_load(config, dtype, file_dtype, tmp_path, monkeypatch):
    directory = _save(config, tmp_path, file_dtype)
    total = {}
    for rank in range(WORLD):
        tp = TensorParallel(rank, WORLD)
        expected = shard_model(load_diffllama(directory, dtype=dtype), tp)
        recorder = _Recorder()
        monkeypatch.setattr(loader, "safe_open", recorder.open)
        got = load_diffllama(directory, dtype=dtype, tp=tp)
        monkeypatch.setattr(loader, "safe_open", _real_safe_open)
        assert got.tp_config == expected.tp_config and got.config == expected.config
        for kind in ("named_parameters", "named_buffers"):
            want, have = dict(getattr(expected, kind)()), dict(getattr(got, kind)())
            assert want.keys() == have.keys(), kind
            for name in want:
                assert have[name].dtype == want[name].dtype and have[name].device == want[name].device, name
                torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)
        assert (got.lm_head.weight is got.model.embed_tokens.weight) == config.tie_word_embeddings
        for a, b in zip(got.modules(), expected.modules()):
            assert type(a) is type(b)
            for attr in ("num_heads", "num_kv_heads", "start", "out_features", "in_features"):
                assert getattr(a, attr, None) == getattr(b, attr, None), (type(a), attr)
            assert (getattr(a, "tp", None) is None) == (getattr(b, "tp", None) is None)
        # a rank reads about 1/WORLD of each sharded tensor (all of the replicated ones)
        with loader.safe_open(directory / "model.safetensors", framework="pt") as f:
            sizes = {n: f.get_slice(n)[:].numel() * f.get_slice(n)[:].element_size() for n in f.keys()}
        for name, size in sizes.items():
            read = recorder.bytes.get(name, 0)
            total[name] = total.get(name, 0) + read
            if any(f".{part}." in f".{name}" for part in SHARDED):
                bias_on_rank0 = name.endswith("bias") and ("o_proj" in name or "down_proj" in name)
                assert read == (size if rank == 0 else 0) if bias_on_rank0 else read == size // WORLD, name
            else:
                assert read == size, name
    sharded = sum(s for n, s in sizes.items() if any(f".{p}.weight" in f".{n}" for p in SHARDED))
    assert sum(total[n] for n in sizes if any(f".{p}.weight" in f".{n}" for p in SHARDED)) == sharded


def test_sharded_load_world_of_one_is_the_full_model(tmp_path):
    directory = _save(GQA, tmp_path)
    full, one = load_diffllama(directory), load_diffllama(directory, tp=TensorParallel())
    assert one.tp is None
    for (n, a), (_, b) in zip(full.named_parameters(), one.named_parameters()):
        assert torch.equal(a, b), n


def test_sharded_load_checks_names_before_reading(tmp_path):
    directory = _save(GQA, tmp_path)
    from safetensors.torch import load_file, save_file
    state = load_file(directory / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, directory / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*up_proj"):
        load_diffllama(directory, tp=TensorParallel(1, WORLD))
