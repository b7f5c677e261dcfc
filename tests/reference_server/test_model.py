"""The paged model against its dense reference, weights, sampling, tokenizer (reference_server.model/tokenizer).

All on the `tiny` preset, CPU float32 (CUDA too when present): paged and dense logits agree to ~1e-6.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from reference_server import tokenizer
from reference_server.kv_cache import BlockAllocator, BlockTable, KVCachePool
from reference_server.model import (
    ModelArgs,
    SeqSlice,
    Transformer,
    build_model,
    decode_one_token,
    generate,
    prefill,
    sample_no_sync,
)
from reference_server.scheduler import Request, Scheduler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ATOL = 2e-4
TINY = ModelArgs.from_name("tiny")


@pytest.fixture(scope="module", params=DEVICES)
def model(request: pytest.FixtureRequest) -> Transformer:
    return build_model(TINY, seed=1234, device=request.param)


def make_cache(model: Transformer, block_size: int, num_blocks: int = 64) -> tuple[KVCachePool, BlockAllocator]:
    pool = KVCachePool(model.args, num_blocks, block_size, device=model.device, dtype=torch.float32)
    return pool, BlockAllocator(num_blocks, block_size)


def ids(values: list[int], model: Transformer) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=model.device)


def prompt_of(length: int, salt: int) -> list[int]:
    generator = torch.Generator().manual_seed(salt)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


# --- paged == dense -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 256])
def test_paged_chunked_prefill_then_decode_matches_dense_forward(model: Transformer, block_size: int) -> None:
    pool, allocator = make_cache(model, block_size, num_blocks=24)
    tokens = prompt_of(300, salt=1)  # > 256: two blocks even at the largest block size
    table = allocator.allocate_table(310)
    chunk_ends = [70, 257, 300]  # uneven chunks, one ending just past a block boundary
    start = 0
    for end in chunk_ends:
        logits = model([SeqSlice(ids(tokens[start:end], model), start, table)], pool)
        dense = model.forward_dense(ids(tokens[:end], model))
        torch.testing.assert_close(logits[0], dense[end - 1], atol=ATOL, rtol=0)
        start = end
    assert table.num_tokens == 300

    next_token = int(logits[0].argmax())
    for _ in range(6):
        tokens.append(next_token)
        position = len(tokens) - 1
        logits = model([SeqSlice(ids([next_token], model), position, table)], pool)
        dense = model.forward_dense(ids(tokens, model))
        torch.testing.assert_close(logits[0], dense[-1], atol=ATOL, rtol=0)
        next_token = int(logits[0].argmax())


def test_one_mixed_iteration_of_decodes_and_prefill_chunks_matches_dense(model: Transformer) -> None:
    pool, allocator = make_cache(model, 16)
    decoding, chunked, fresh = prompt_of(40, 2), prompt_of(90, 3), prompt_of(25, 4)
    decoding_table, chunked_table, fresh_table = (allocator.allocate_table(100) for _ in range(3))
    model([SeqSlice(ids(decoding, model), 0, decoding_table)], pool)
    model([SeqSlice(ids(chunked[:50], model), 0, chunked_table)], pool)

    decoding.append(65)
    batch = [
        SeqSlice(ids([65], model), 40, decoding_table),  # a decode token
        SeqSlice(ids(chunked[50:], model), 50, chunked_table),  # the second chunk of a prompt
        SeqSlice(ids(fresh, model), 0, fresh_table),  # a whole new prompt
    ]
    logits = model(batch, pool)
    assert logits.shape == (3, TINY.vocab_size)
    for row, sequence in enumerate([decoding, chunked, fresh]):
        dense = model.forward_dense(ids(sequence, model))
        torch.testing.assert_close(logits[row], dense[-1], atol=ATOL, rtol=0)


def test_prefix_cache_hit_reuses_cached_kv_and_matches_dense(model: Transformer) -> None:
    pool, allocator = make_cache(model, 16)
    shared = prompt_of(50, 5)
    first = shared + prompt_of(10, 6)
    table = allocator.allocate_table(len(first))
    model([SeqSlice(ids(first, model), 0, table)], pool)
    allocator.cache_full_blocks(table, first)
    allocator.free(table.block_ids)

    second = shared + prompt_of(20, 7)
    hit = allocator.lookup_prefix(second, max_tokens=len(second) - 1)
    assert hit.num_tokens == 48 and hit.block_ids == tuple(table.block_ids[:3])
    second_table = BlockTable(16, [*hit.block_ids, *allocator.allocate(2)], hit.num_tokens)
    logits = model([SeqSlice(ids(second[48:], model), 48, second_table)], pool)  # only the uncached tail
    torch.testing.assert_close(logits[0], model.forward_dense(ids(second, model))[-1], atol=ATOL, rtol=0)


def test_forward_refuses_a_block_table_too_short_and_a_pool_of_another_dtype(model: Transformer) -> None:
    pool, allocator = make_cache(model, 16)
    table = allocator.allocate_table(16)
    with pytest.raises(ValueError, match="holds 16 tokens, slice needs 20"):
        model([SeqSlice(ids(list(range(20)), model), 0, table)], pool)
    half_pool = KVCachePool(model.args, 4, 16, device=model.device, dtype=torch.float16)
    with pytest.raises(ValueError, match="KV pool is torch.float16"):
        model([SeqSlice(ids([1], model), 0, table)], half_pool)


def test_forward_and_sampling_never_read_device_values_on_the_host() -> None:
    """On the meta device any host read (.item(), .tolist(), a data-dependent branch) raises."""
    meta_model = build_model(TINY, device="meta")
    pool = KVCachePool(TINY, 8, 16, device="meta", dtype=torch.float32)
    tables = [BlockAllocator(8, 16).allocate_table(40) for _ in range(2)]
    batch = [
        SeqSlice(torch.zeros(30, dtype=torch.long, device="meta"), 0, tables[0]),
        SeqSlice(torch.zeros(1, dtype=torch.long, device="meta"), 20, tables[1]),
    ]
    tokens = decode_one_token(meta_model, batch, pool, temperature=torch.tensor([0.0, 0.8], device="meta"))
    assert tokens.shape == (2,) and tokens.device.type == "meta"
    assert sample_no_sync(torch.empty(3, 258, device="meta"), 0.7).shape == (3,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync detection needs a GPU")
def test_decode_step_and_sampling_do_not_sync_cuda() -> None:
    cuda_model = build_model(TINY, seed=1, device="cuda")
    pool, allocator = make_cache(cuda_model, 16)
    table = allocator.allocate_table(40)
    prompt = ids(prompt_of(30, 8), cuda_model)
    generator = torch.Generator(device="cuda").manual_seed(0)
    token = prefill(cuda_model, SeqSlice(prompt, 0, table), pool)
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode_one_token(cuda_model, [SeqSlice(token, 30, table)], pool, temperature=0.8, generator=generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- continuous batching end to end -----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["colocated", "chunked"])
def test_scheduled_batches_produce_the_same_tokens_as_generating_alone(model: Transformer, policy: str) -> None:
    pool, allocator = make_cache(model, 16, num_blocks=48)
    prompts = [prompt_of(n, 10 + n) for n in (5, 70, 33, 120)]
    alone = [generate(model, p, 8, pool, allocator, stop_at_eos=False) for p in prompts]
    assert allocator.num_free_blocks == 48

    scheduler = Scheduler(policy, 48, 4, allocator, max_context_tokens=model.args.max_seq_len)
    sequences = [scheduler.add(Request(f"r{i}", p, 8, stop_token_ids=frozenset())) for i, p in enumerate(prompts)]
    while scheduler.has_work:
        plan = scheduler.schedule()
        batch = [SeqSlice(ids([d.token_id], model), d.position, d.seq.block_table) for d in plan.decodes] + [
            SeqSlice(ids(list(c.token_ids), model), c.start, c.seq.block_table) for c in plan.prefills
        ]
        tokens = decode_one_token(model, batch, pool)
        scheduler.on_step_done(plan, tokens.tolist())
    assert [seq.output_token_ids for seq in sequences] == alone
    assert allocator.num_free_blocks == 48


# --- weights ----------------------------------------------------------------------------------------


def test_same_seed_gives_the_same_weights_in_another_process() -> None:
    def checksum(seed: int) -> str:
        code = (
            "import hashlib, torch\n"
            "from reference_server.model import ModelArgs, build_model\n"
            f"m = build_model(ModelArgs.from_name('tiny'), seed={seed})\n"
            "h = hashlib.sha256()\n"
            "[h.update(p.detach().numpy().tobytes()) for p in m.parameters()]\n"
            "print(h.hexdigest())\n"
        )
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        ).stdout.strip()

    here = build_model(TINY, seed=7)
    local = hashlib.sha256()
    for param in here.parameters():
        local.update(param.detach().numpy().tobytes())
    assert checksum(7) == local.hexdigest()
    assert build_model(TINY, seed=8).output.weight.ne(here.output.weight).any()


def test_logits_are_spread_and_greedy_outputs_vary_with_the_prompt(model: Transformer) -> None:
    logits = model.forward_dense(ids(prompt_of(64, 9), model))
    assert 0.3 < float(logits.std()) < 5.0
    assert len(set(logits.argmax(-1).tolist())) > 10
    probs = torch.softmax(logits, -1)
    assert float(probs.max()) < 0.9  # no position is a foregone conclusion


def test_bf16_weights_keep_float32_rope_tables() -> None:
    model_bf16 = build_model(TINY, seed=1, dtype=torch.bfloat16)
    assert model_bf16.output.weight.dtype == torch.bfloat16
    assert model_bf16.rope_cos.dtype == torch.float32
    model_f32 = build_model(TINY, seed=1)
    torch.testing.assert_close(model_bf16.output.weight.float(), model_f32.output.weight, atol=1e-2, rtol=1e-2)


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'llama9'; choose one of tiny, small"):
        ModelArgs.from_name("llama9")


# --- sampling ---------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 258, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_no_sync(logits, 0.0), logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(20000, 3)
    first = sample_no_sync(logits, 1.0, torch.Generator().manual_seed(42))
    again = sample_no_sync(logits, 1.0, torch.Generator().manual_seed(42))
    other = sample_no_sync(logits, 1.0, torch.Generator().manual_seed(43))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    frequencies = torch.bincount(first, minlength=3).float() / 20000
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.2]), atol=0.015, rtol=0)


def test_per_row_temperature_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.randn(400, 258, generator=torch.Generator().manual_seed(1))
    temperature = torch.tensor([0.0, 2.0]).repeat(200)
    tokens = sample_no_sync(logits, temperature, torch.Generator().manual_seed(2))
    greedy = logits.argmax(-1)
    assert torch.equal(tokens[0::2], greedy[0::2])
    assert (tokens[1::2] != greedy[1::2]).float().mean() > 0.5  # hot rows mostly leave the argmax
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample_no_sync(logits, -1.0)


# --- tokenizer --------------------------------------------------------------------------------------


def test_tokenizer_round_trip_with_specials_skipped() -> None:
    text = "héllo, wörld — 你好 🙂"
    encoded = tokenizer.encode(text, add_bos=True)
    assert encoded[0] == tokenizer.BOS_ID and all(0 <= t < 256 for t in encoded[1:])
    assert tokenizer.decode(encoded + [tokenizer.EOS_ID]) == text
    assert tokenizer.decode([0xFF, 0x41]) == "\ufffdA"
    with pytest.raises(ValueError, match="outside the byte tokenizer's vocab"):
        tokenizer.decode([300])
    assert TINY.vocab_size >= tokenizer.VOCAB_SIZE


def test_streaming_decoder_holds_back_split_multibyte_characters() -> None:
    data = tokenizer.encode("a🙂b你")
    decoder = tokenizer.StreamingDecoder()
    pieces = [decoder.push([token]) for token in data]
    assert pieces == ["a", "", "", "", "🙂", "b", "", "", "你"]
    assert decoder.push(tokenizer.encode("é")[:1]) == ""
    assert decoder.flush() == "\ufffd"  # a character cut off for good
    assert decoder.push(tokenizer.encode("ok")) == "ok"
