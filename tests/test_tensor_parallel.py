"""Tensor parallelism on the CPU (gloo, 2 processes): a TP=2 shard gives the unsharded
model's logits (fp32 tolerance) and, through the Engine, its greedy tokens, for a GQA and an
MHA config (the MHA one with KV sharing, a sliding window, affine subln, biases and tied
embeddings), differential and plain attention; and a clear error for sizes that don't split.
On two GPUs, the compiled, graph-replayed TP=2 engine gives the same tokens with the
symmetric-memory all-reduce as over NCCL."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp

from compiled_attn.distributed import TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from compiled_attn.engine import Engine
from compiled_attn.kv_cache import calibrate_kv_scales
from compiled_attn.metadata import SequenceChunk, build_metadata
from compiled_attn.models import DiffLlamaConfig, build_random_model, save_diffllama
from compiled_attn.models.sharding import check_tensor_parallel, shard_model
from compiled_attn.sampling import SamplingParams

GQA = DiffLlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=64,
    bos_token_id=None, eos_token_id=None,
)
MHA = dataclasses.replace(
    GQA, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, sliding_window=5,
    subln_affine=True, kv_sharing={2: 0}, attention_bias=True, tie_word_embeddings=True,
)
CASES = [("gqa", GQA, True), ("mha", MHA, True), ("gqa-plain", GQA, False)]
PROMPTS = [[1, 2, 3], [10, 11, 12, 13, 14, 15, 16], [40], [5, 9, 17, 33, 2]]
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(config, differential, seed=0):
    model = build_random_model(config, seed=seed, differential=differential)
    if config.attention_bias:  # random biases (the builder zeroes them)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def _caches(model):
    """Zeroed paged caches for the model's (or its shard's) KV heads: 2 blocks of 4 per prompt."""
    config = getattr(model, "tp_config", model.config)
    shape = (2 * len(PROMPTS), 4, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_cache_layers)]


def _worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = init_tensor_parallel(WORLD, rank, backend="gloo")
    try:
        for name, config, differential in CASES:
            full, shard = _model(config, differential), shard_model(_model(config, differential), tp)
            assert shard.lm_head.weight.shape[0] == config.vocab_size // WORLD
            assert shard.model.layers[0].self_attn.num_kv_heads == config.num_key_value_heads // WORLD
            md = build_metadata([SequenceChunk(p, 0, [2 * i, 2 * i + 1]) for i, p in enumerate(PROMPTS)], 4, 2)
            expected, got = (m(md, _caches(m), all_logits=True) for m in (full, shard))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            params = SamplingParams(max_new_tokens=8)
            outputs = []
            for model in (full, shard):
                engine = Engine(model, block_size=4, compile=False)
                outputs.append([c.output_ids for c in engine.generate(PROMPTS, params)[0]])
            sampled = [c.output_ids for c in Engine(shard, block_size=4, compile=False).generate(
                PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9), seed=3)[0]]
            # fp8 calibration of a shard: the unsharded model's scales (maxima over every rank's KV heads)
            scales = [calibrate_kv_scales(m, PROMPTS) for m in (full, shard)]
            torch.testing.assert_close(scales[1], scales[0], rtol=1e-5, atol=0)
            results[(rank, name)] = (outputs[0], outputs[1], sampled)
    finally:
        destroy_tensor_parallel()


def test_tp2_matches_tp1():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    for name, _, _ in CASES:
        tp1, tp2, sampled = results[(0, name)]
        assert tp2 == tp1, name  # greedy tokens identical
        assert all(len(o) == 8 for o in tp2)
        # every rank produced the same tokens (same gathered logits, same seeds)
        assert results[(1, name)][1] == tp2 and results[(1, name)][2] == sampled, name


def _compiled_worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = init_tensor_parallel(WORLD, rank, backend="gloo")
    try:
        engine = Engine(shard_model(_model(GQA, True), tp), block_size=4, compile=True)
        tokens = [c.output_ids for c in engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))[0]]
        stats = engine.compile_stats
        results[rank] = (tokens, stats.graph_breaks, stats.recompiles)
    finally:
        destroy_tensor_parallel()


def test_tp2_compiled_has_no_graph_breaks():
    """torch.compile(fullgraph=True) traces the functional collectives: no graph break, the
    eager TP=1 tokens."""
    results = mp.Manager().dict()
    mp.spawn(_compiled_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    expected = [c.output_ids for c in Engine(_model(GQA, True), block_size=4, compile=False).generate(
        PROMPTS, SamplingParams(max_new_tokens=8))[0]]
    for rank in range(WORLD):
        tokens, graph_breaks, recompiles = results[rank]
        assert tokens == expected and graph_breaks == 0 and recompiles == 0


def test_sizes_that_do_not_split_raise():
    config = dataclasses.replace(GQA, num_key_value_heads=2)  # one KV pair
    with pytest.raises(ValueError, match=r"KV head pairs \(num_key_value_heads / 2\) = 1"):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="query head pairs"):
        shard_model(build_random_model(dataclasses.replace(GQA, num_attention_heads=6, num_key_value_heads=2)),
                    TensorParallel(0, 2))


def test_a_shard_is_not_sharded_again_nor_saved(tmp_path):
    shard = shard_model(build_random_model(GQA), TensorParallel(0, 2))
    with pytest.raises(ValueError, match="shard already"):
        shard_model(shard, TensorParallel(0, 2))
    with pytest.raises(ValueError, match="tensor-parallel shard"):
        save_diffllama(shard, tmp_path / "shard")


def test_world_of_one_is_unchanged():
    model = build_random_model(GQA)
    assert shard_model(model, TensorParallel()) is model
    assert model.tp is None and all(getattr(m, "tp", None) is None for m in model.modules())


def _serving_worker(rank: int, port: int, results: dict) -> None:
    """Rank 0 adds requests between steps (a serving loop); rank 1 adds none and runs
    serve_worker(); then rank 1 adds a request that differs from rank 0's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = init_tensor_parallel(WORLD, rank, backend="gloo")
    try:
        engine = Engine(shard_model(_model(GQA, True), tp), block_size=4, compile=False)
        params = SamplingParams(max_new_tokens=6)
        if rank == 0:
            requests = [engine.add_request(PROMPTS[0], params, seed=0)]
            for step in range(12):  # the others arrive while the first decodes
                if step in (2, 5, 6):
                    requests.append(engine.add_request(PROMPTS[len(requests)], params, seed=len(requests)))
                engine.step()
            while engine.has_unfinished():
                engine.step()
            engine.stop_workers()
            again = engine.add_request(PROMPTS[1], params, seed=9)  # a second serving session
            while engine.has_unfinished():
                engine.step()
            engine.stop_workers()
            with pytest.raises(RuntimeError, match="called already"):
                engine.stop_workers()
            results[rank] = [r.output_ids for r in requests + [again]]
        else:
            engine.serve_worker()
            engine.serve_worker()
            results[rank] = "stopped twice"
        # every rank adds one more request; rank 1's prompt differs from rank 0's
        engine.add_request(PROMPTS[0] if rank == 0 else PROMPTS[1], params)
        try:
            engine.step()
            results[(rank, "mismatch")] = None
        except RuntimeError as error:
            results[(rank, "mismatch")] = str(error)
    finally:
        destroy_tensor_parallel()


def test_rank0_requests_reach_a_serving_worker():
    """Requests that only rank 0 adds, at steps of its choosing, run on every rank in
    lock-step (rank 1's serve_worker ends at rank 0's stop_workers), with the tokens of an
    unsharded engine; a request another rank adds unlike rank 0's is a clear error."""
    results = mp.Manager().dict()
    mp.spawn(_serving_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    params = SamplingParams(max_new_tokens=6)
    engine = Engine(_model(GQA, True), block_size=4, compile=False)
    for i, prompt in enumerate(PROMPTS + PROMPTS[1:2]):  # greedy: tokens do not depend on batching
        assert results[0][i] == [c.output_ids for c in engine.generate([prompt], params)[0]][0], i
    assert all(len(tokens) == 6 for tokens in results[0])
    assert results[1] == "stopped twice"
    # (rank 0 then fails in the step's first collective, its peer having left)
    assert re.search(r"rank 1's request \d+ differs from rank 0's request \d+ in its prompt", results[(1, "mismatch")])


def _settings_worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = init_tensor_parallel(WORLD, rank, backend="gloo")
    cases = {"num_blocks": (GQA, dict(num_blocks=32 + rank)), "warmup": (GQA, dict(warmup=rank == 0)),
             "model_config": (dataclasses.replace(GQA, eos_token_id=5 if rank == 0 else None), {})}
    try:
        for name, (config, kwargs) in cases.items():
            try:
                Engine(shard_model(_model(config, True), tp), block_size=4, compile=False, **kwargs)
                results[(rank, name)] = None
            except RuntimeError as error:
                results[(rank, name)] = str(error)
    finally:
        destroy_tensor_parallel()


def test_engines_built_unlike_on_the_ranks_raise_on_every_rank():
    """The schedule depends on the engine's settings and the model's config: ranks whose
    engines differ (num_blocks, warmup, the model's EOS id) all raise before any step,
    instead of hanging in a collective; the differing rank names the setting."""
    results = mp.Manager().dict()
    mp.spawn(_settings_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    for name in ("num_blocks", "warmup", "model_config"):
        for rank in range(WORLD):
            error = results[(rank, name)]
            assert error is not None and "engines of the tensor-parallel ranks differ" in error, (name, rank)
        assert f"{name}: " in results[(1, name)] and "on rank 0" in results[(1, name)], name
    assert "num_blocks: 33 here, 32 on rank 0" in results[(1, "num_blocks")]


GPU_CONFIG = dataclasses.replace(GQA, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 head_dim=32, max_position_embeddings=256)


def _symm_mem_engine_worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (the machine's rule)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    tp = init_tensor_parallel(WORLD, rank, backend="nccl", all_reduce="symm_mem")
    engines = []
    try:
        for kind in ("nccl", "symm_mem"):
            model = build_random_model(GPU_CONFIG, seed=0, device="cuda")
            model.lm_head.weight.mul_(30.0)  # wide logit margins: greedy picks are not near-ties
            engines.append(Engine(shard_model(model, dataclasses.replace(tp, all_reduce=kind)), max_num_seqs=8,
                                  compile=True, cuda_graphs=True))
            completions = engines[-1].generate(PROMPTS, SamplingParams(max_new_tokens=16))[0]
            stats = engines[-1].compile_stats
            results[(rank, kind)] = ([c.output_ids for c in completions], stats.graph_breaks, stats.recompiles,
                                     engines[-1].capture_stats is not None)
    finally:
        engines.clear()  # NCCL's destroy_process_group hangs while their CUDA graphs live
        destroy_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs (TP=2 over NCCL and symmetric memory)")
def test_tp2_engine_with_symm_mem_all_reduce_gives_the_tokens_of_nccl():
    """The compiled, graph-replayed TP=2 engine (float32) with the symmetric-memory all-reduce
    gives the greedy tokens of the same engine over NCCL, with no graph break nor recompile."""
    results = mp.Manager().dict()
    mp.spawn(_symm_mem_engine_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        nccl, symm_mem = results[(rank, "nccl")], results[(rank, "symm_mem")]
        assert symm_mem == nccl and nccl[1:] == (0, 0, True), rank
        assert all(len(tokens) == 16 for tokens in nccl[0])


def _bench_worker(rank: int, port: int, results_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank))
    torch.set_num_threads(1)
    from compiled_attn.cli import main

    assert main(["bench", "--tensor-parallel-size", "2", "--device", "cpu", "--batch-sizes", "1", "3",
                 "--prompt-len", "6", "--new-tokens", "3", "--results-dir", results_dir]) == 0


def test_cli_bench_with_tensor_parallelism_times_decode_on_rank_0(tmp_path):
    """``compiled-attn bench --tensor-parallel-size 2`` (here gloo, the 3 M model): rank 0
    appends one record per batch size."""
    mp.spawn(_bench_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    records = [json.loads(line) for line in (tmp_path / "tp_decode.jsonl").read_text().splitlines()]
    assert [(r["tp"], r["batch"], r["device"]) for r in records] == [(2, 1, "cpu"), (2, 3, "cpu")]
    assert all(r["step_seconds"] > 0 for r in records)
