"""Iteration plans of every policy, admission, finishing and freeing (reference_server.scheduler).

No model here: tokens are chosen by the test, so every plan is exactly predictable.
"""

from __future__ import annotations

import random

import pytest

from reference_server.kv_cache import BlockAllocator, OutOfBlocks
from reference_server.scheduler import (
    QueueFull,
    Request,
    RequestRejected,
    Scheduler,
    SeqState,
    StepOutcome,
    StepPlan,
)
from reference_server.tokenizer import EOS_ID

NOT_EOS = 7


def request(request_id: str, prompt_tokens: int, max_new_tokens: int = 4, first_token: int = 1) -> Request:
    return Request(request_id, tuple(range(first_token, first_token + prompt_tokens)), max_new_tokens)


def run_step(scheduler: Scheduler, token: int = NOT_EOS) -> tuple[StepPlan, StepOutcome | None]:
    plan = scheduler.schedule()
    if plan.is_empty:
        return plan, None
    return plan, scheduler.on_step_done(plan, [token] * len(plan.sequences))


def make(policy: str, *, budget: int = 64, max_batch: int = 8, blocks: int = 64, **kwargs: object) -> Scheduler:
    return Scheduler(policy, budget, max_batch, BlockAllocator(blocks, 16), **kwargs)


def start_decoding(scheduler: Scheduler, *requests: Request) -> None:
    for req in requests:
        scheduler.add(req)
    while any(scheduler.get(r.request_id).state is not SeqState.DECODING for r in requests):
        run_step(scheduler)


def drain(scheduler: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_work:
            return
        run_step(scheduler)
    raise AssertionError("scheduler did not drain")


# --- colocated ------------------------------------------------------------------------------------


def test_colocated_puts_a_whole_prefill_in_the_same_step_as_every_running_decode() -> None:
    scheduler = make("colocated", budget=64)
    start_decoding(scheduler, request("a", 10, max_new_tokens=50), request("b", 12, max_new_tokens=50))
    scheduler.add(request("long", 300))  # far over the budget: joins whole anyway
    scheduler.add(request("next", 20, first_token=1000))  # no prefix shared with "long"

    plan = scheduler.schedule()
    assert [d.seq.seq_id for d in plan.decodes] == ["a", "b"]
    assert [(d.token_id, d.position) for d in plan.decodes] == [(NOT_EOS, 10), (NOT_EOS, 12)]
    assert [(c.seq.seq_id, c.start, c.end, c.is_last) for c in plan.prefills] == [("long", 0, 300, True)]
    assert plan.num_decode_requests == 2
    assert plan.prefill_tokens == 300
    assert plan.context_tokens == 11 + 13 + 300  # each decode attends its prompt + the fed token
    scheduler.on_step_done(plan, [NOT_EOS] * 3)

    plan, _ = run_step(scheduler)  # "next" fits the budget left after three decodes
    assert plan.num_decode_requests == 3
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == [("next", 0, 20)]


def test_colocated_joins_further_prompts_only_within_the_budget() -> None:
    scheduler = make("colocated", budget=64)
    for i in range(3):
        scheduler.add(request(f"r{i}", 30, first_token=100 * i))
    plan = scheduler.schedule()
    assert [c.seq.seq_id for c in plan.prefills] == ["r0", "r1"]  # 30 + 30 <= 64 < 90
    assert scheduler.num_waiting == 1


# --- chunked --------------------------------------------------------------------------------------


def test_chunked_runs_decodes_first_then_prefill_chunks_up_to_the_budget() -> None:
    scheduler = make("chunked", budget=32)
    start_decoding(scheduler, *(request(f"d{i}", 8, max_new_tokens=40, first_token=50 * i) for i in range(3)))
    scheduler.add(request("long", 100, first_token=200))
    scheduler.add(request("short", 10, first_token=400))

    chunks = []
    attention = []
    while scheduler.get("long").state is not SeqState.DECODING:
        plan, _ = run_step(scheduler)
        assert [d.seq.seq_id for d in plan.decodes] == ["d0", "d1", "d2"]
        assert plan.num_tokens <= 32
        chunks.append([(c.seq.seq_id, c.start, c.end) for c in plan.prefills])
        attention.append(plan.prefill_attention_tokens2)
    # The step attribute: each chunk attends over its prompt so far; "long"'s chunks add up to 100^2.
    assert attention == [29**2, 58**2 - 29**2, 87**2 - 58**2, 100**2 - 87**2 + 10**2]
    assert chunks == [
        [("long", 0, 29)],
        [("long", 29, 58)],
        [("long", 58, 87)],
        [("long", 87, 100), ("short", 0, 10)],
    ]
    assert scheduler.get("long").num_prefill_chunks == 4
    assert scheduler.get("long").output_token_ids == [NOT_EOS]


def test_chunked_never_exceeds_the_budget_under_random_load() -> None:
    rng = random.Random(3)
    scheduler = make("chunked", budget=48, max_batch=6, blocks=200, max_context_tokens=512)
    for i in range(25):
        scheduler.add(request(f"r{i}", rng.randint(1, 200), max_new_tokens=rng.randint(1, 30), first_token=i * 1000))
    steps = 0
    while scheduler.has_work:
        plan, outcome = run_step(scheduler)
        assert 0 < plan.num_tokens <= 48
        assert scheduler.num_running <= 6
        steps += 1
        assert steps < 2000
    assert scheduler.allocator.num_free_blocks == 200


def test_chunked_budget_must_leave_room_beyond_the_decodes() -> None:
    with pytest.raises(ValueError, match="token_budget > max_batch_seqs"):
        make("chunked", budget=8, max_batch=8)


# --- prefill-only / decode-only -------------------------------------------------------------------


def test_prefill_only_plans_no_decodes_and_hands_off_with_blocks_held() -> None:
    scheduler = make("prefill-only", budget=64, blocks=8)
    scheduler.add(request("a", 40, max_new_tokens=100))  # decode tokens are not reserved here
    plan, outcome = run_step(scheduler, token=NOT_EOS)
    assert plan.decodes == () and [(c.start, c.end) for c in plan.prefills] == [(0, 40)]
    assert [s.seq_id for s in outcome.handed_off] == ["a"]
    assert outcome.emitted == [(outcome.handed_off[0], NOT_EOS)]
    seq = outcome.handed_off[0]
    assert seq.state is SeqState.HANDED_OFF and len(seq.block_table.block_ids) == 3
    assert scheduler.num_running == 0 and not scheduler.has_work
    assert scheduler.schedule().is_empty  # nothing more to do for it here

    scheduler.finish("a")  # the KV transfer is done
    assert scheduler.allocator.num_free_blocks == 8


def test_prefill_only_first_token_that_ends_the_request_is_not_handed_off() -> None:
    scheduler = make("prefill-only")
    scheduler.add(request("a", 5))
    _, outcome = run_step(scheduler, token=EOS_ID)
    assert outcome.handed_off == [] and [s.finish_reason for s in outcome.finished] == ["stop"]
    assert scheduler.allocator.num_free_blocks == 64


def test_decode_only_runs_prefilled_sequences_from_their_first_token() -> None:
    scheduler = make("decode-only", budget=64, max_batch=2, blocks=16)
    with pytest.raises(RequestRejected, match="add_prefilled"):
        scheduler.add(request("x", 4))
    tables = []
    for name in ("a", "b", "c"):
        table = scheduler.allocator.allocate_table(20)  # the receiver's blocks for a 20-token prompt
        tables.append(table)
        scheduler.add_prefilled(request(name, 20, max_new_tokens=3), table, first_token_id=11)
    assert len(tables[0].block_ids) == 2  # grown to hold 20 + 3 - 1 = 22 positions

    plan, outcome = run_step(scheduler, token=12)
    assert plan.prefills == ()
    assert [(d.seq.seq_id, d.token_id, d.position) for d in plan.decodes] == [("a", 11, 20), ("b", 11, 20)]
    plan, outcome = run_step(scheduler, token=13)
    assert [(d.seq.seq_id, d.token_id, d.position) for d in plan.decodes] == [("a", 12, 21), ("b", 12, 21)]
    assert sorted(s.seq_id for s in outcome.finished) == ["a", "b"]
    assert scheduler.get("c").state is SeqState.WAITING  # max_batch 2: it waited with its blocks
    drain(scheduler)
    assert scheduler.allocator.num_free_blocks == 16


def test_decode_only_refuses_a_table_without_the_prompt_and_a_pool_too_small() -> None:
    scheduler = make("decode-only", blocks=6)
    with pytest.raises(RequestRejected, match="holds 16 tokens, prompt has 20"):
        scheduler.add_prefilled(request("a", 20), scheduler.allocator.allocate_table(16), first_token_id=1)
    table = scheduler.allocator.allocate_table(48)
    with pytest.raises(OutOfBlocks):
        scheduler.add_prefilled(request("b", 48, max_new_tokens=40), table, first_token_id=1)
    assert len(table.block_ids) == 3  # nothing taken, nothing leaked: the caller still owns it


# --- admission, limits, ending --------------------------------------------------------------------


def test_admission_stops_at_max_batch_and_at_free_blocks_in_fcfs_order() -> None:
    scheduler = make("chunked", budget=512, max_batch=2, blocks=64)
    for i in range(3):
        scheduler.add(request(f"r{i}", 10, first_token=100 * i))
    plan = scheduler.schedule()
    assert [c.seq.seq_id for c in plan.prefills] == ["r0", "r1"]
    scheduler.on_step_done(plan, [NOT_EOS] * 2)

    scheduler = make("chunked", budget=512, blocks=4)
    scheduler.add(request("big", 60))  # 60 + 3 positions: 4 blocks, all of them
    scheduler.add(request("small", 1, first_token=900))
    plan = scheduler.schedule()
    assert [c.seq.seq_id for c in plan.prefills] == ["big"]
    assert scheduler.num_waiting == 1 and scheduler.allocator.num_free_blocks == 0


def test_prompt_over_the_context_limit_is_rejected_clearly() -> None:
    scheduler = make("colocated", max_context_tokens=128)
    with pytest.raises(RequestRejected, match=r"prompt \(126 tokens\) \+ max_new_tokens \(4\) exceeds .* 128"):
        scheduler.add(request("long", 126))
    with pytest.raises(RequestRejected, match="whole cache has 64"):
        make("colocated", blocks=64).add(request("huge", 64 * 16 + 1))
    with pytest.raises(RequestRejected, match="empty prompt"):
        Request("e", (), 4)
    assert scheduler.num_waiting == 0


def test_waiting_queue_is_bounded() -> None:
    scheduler = make("colocated", max_waiting_requests=2)
    scheduler.add(request("a", 4))
    scheduler.add(request("b", 4))
    with pytest.raises(QueueFull, match="bound 2"):
        scheduler.add(request("c", 4))
    assert scheduler.num_waiting == 2


def test_duplicate_live_request_id_is_refused() -> None:
    scheduler = make("colocated")
    scheduler.add(request("a", 4))
    with pytest.raises(RequestRejected, match="already live"):
        scheduler.add(request("a", 4))


def test_stop_token_and_length_finish_and_free() -> None:
    scheduler = make("colocated", blocks=8)
    scheduler.add(request("stops", 10, max_new_tokens=20))
    scheduler.add(request("runs", 10, max_new_tokens=3, first_token=50))
    _, outcome = run_step(scheduler)
    plan = scheduler.schedule()
    outcome = scheduler.on_step_done(plan, [EOS_ID, NOT_EOS])
    assert [(s.seq_id, s.finish_reason) for s in outcome.finished] == [("stops", "stop")]
    _, outcome = run_step(scheduler)
    assert [(s.seq_id, s.finish_reason, len(s.output_token_ids)) for s in outcome.finished] == [("runs", "length", 3)]
    assert scheduler.allocator.num_free_blocks == 8


def test_abort_frees_blocks_in_every_state_including_mid_step() -> None:
    scheduler = make("chunked", budget=20, blocks=32)
    scheduler.add(request("waiting", 10, first_token=1))
    scheduler.abort("waiting")
    for i in range(3):
        scheduler.add(request(f"r{i}", 30, first_token=100 * i))
    plan = scheduler.schedule()  # r0 is mid-prefill, r1/r2 not admitted yet
    scheduler.abort("r0")  # the client went away while the step ran
    outcome = scheduler.on_step_done(plan, [NOT_EOS] * len(plan.sequences))
    assert outcome.emitted == [] and scheduler.get("r1").state is SeqState.WAITING
    with pytest.raises(KeyError, match="r0"):
        scheduler.get("r0")
    scheduler.abort("r1")
    scheduler.abort("r2")
    assert scheduler.allocator.num_free_blocks == 32 and not scheduler.has_work


def test_failed_step_ends_its_sequences_and_keeps_the_rest() -> None:
    scheduler = make("colocated", max_batch=1, blocks=16)
    scheduler.add(request("in_step", 10))
    scheduler.add(request("queued", 10, first_token=50))
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="before on_step_done"):
        scheduler.schedule()
    ended = scheduler.on_step_failed(plan)
    assert [(s.seq_id, s.finish_reason) for s in ended] == [("in_step", "error")]
    plan, _ = run_step(scheduler)
    assert [c.seq.seq_id for c in plan.prefills] == ["queued"]


def test_prefix_cache_hit_skips_cached_blocks_and_counts_tokens() -> None:
    scheduler = make("chunked", budget=256, blocks=32)
    prompt = tuple(range(1, 41))  # 2 full blocks + 8
    scheduler.add(Request("first", prompt, 2))
    drain(scheduler)
    scheduler.add(Request("second", prompt + (99,) * 5, 2))
    plan = scheduler.schedule()
    (chunk,) = plan.prefills
    assert (chunk.start, chunk.end) == (32, 45)
    assert chunk.seq.num_cached_tokens == 32
    scheduler.on_step_done(plan, [NOT_EOS])
    assert scheduler.prefix_queried_tokens_total == 40 + 45
    assert scheduler.prefix_hit_tokens_total == 32

    # A prompt of exactly whole cached blocks still recomputes its last block for the first logits.
    scheduler.add(Request("exact", prompt[:32], 2))
    plan = scheduler.schedule()
    assert [(c.start, c.end) for c in plan.prefills if c.seq.seq_id == "exact"] == [(16, 32)]
    scheduler.on_step_done(plan, [NOT_EOS] * len(plan.sequences))
    drain(scheduler)
    assert scheduler.allocator.num_free_blocks == 32


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy 'disagg'"):
        make("disagg")


def test_a_stop_sequence_ends_the_request_and_frees_its_blocks_at_once():
    scheduler = make("colocated")
    stop = (ord("\n"), ord("\n"))
    scheduler.add(Request("r", (1, 2, 3), 50, stop_sequences=(stop,)))
    emitted = []
    for token in (ord("a"), ord("\n"), ord("b"), ord("\n"), ord("\n"), ord("c")):
        _, outcome = run_step(scheduler, token)
        emitted.extend(t for _, t in outcome.emitted)
        if outcome.finished:
            break
    assert emitted == [ord("a"), ord("\n"), ord("b"), ord("\n"), ord("\n")]  # nothing after the stop
    assert outcome.finished[0].finish_reason == "stop"
    assert scheduler.allocator.usage_ratio() == 0 and not scheduler.has_work


def test_requests_refuse_a_bad_top_p_or_an_empty_stop_sequence():
    with pytest.raises(RequestRejected):
        Request("r", (1,), 4, top_p=0.0)
    with pytest.raises(RequestRejected):
        Request("r", (1,), 4, stop_sequences=((),))
