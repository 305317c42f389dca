"""A step's batch: one record per scheduled row (its request, its sequence, its query length, its chunk),
the step input its rows make, and the row a decoding sequence keeps from step to step."""

from __future__ import annotations

from localserve.engine.sequence import RequestState
from tests.helpers.scheduler_states import make_request, make_scheduler, run, sample


def test_each_row_holds_its_request_sequence_query_length_and_chunk():
    scheduler = make_scheduler(16)
    decoding = run(scheduler, make_request(0, list(range(3, 23)), [[5], [6]]))  # two forked samples
    prompt = make_request(1, list(range(30, 50)), [[]], max_tokens=4)
    scheduler.queues.waiting.append(prompt)
    batch = scheduler.schedule()
    assert [(row.request, row.seq, row.query_len) for row in batch.rows] == \
        [(decoding, decoding.seqs[0], 1), (decoding, decoding.seqs[1], 1), (prompt, prompt.seqs[0], 20)]
    for row in batch.rows:
        chunk = row.chunk
        assert chunk.seq_id == row.seq.seq_id and len(chunk.token_ids) == row.query_len
        assert chunk.token_ids == row.seq.token_ids[chunk.start_pos:chunk.context_len]
        assert chunk.block_table == scheduler.block_manager.block_table(row.seq.seq_id)
    # The model runner reads the rows' chunks in row order: its logits rows follow them.
    chunks = batch.step_input.chunks
    assert len(chunks) == 3 and all(chunk is row.chunk for chunk, row in zip(chunks, batch.rows))
    assert batch.num_tokens == 22 and batch.num_prefill_tokens == 20


def test_a_one_token_prefill_chunk_counts_no_prefill_token():
    # Budget 3: the two decodes take 2, the prompt gets a chunk of the one token left.
    scheduler = make_scheduler(16, max_num_seqs=3, budget=3)
    run(scheduler, make_request(0, list(range(3, 23)), [[5], [6]]))
    prompt = make_request(1, list(range(30, 50)), [[]], max_tokens=4)
    scheduler.queues.waiting.append(prompt)
    batch = scheduler.schedule()
    assert [row.query_len for row in batch.rows] == [1, 1, 1] and batch.rows[2].seq is prompt.seqs[0]
    assert batch.num_tokens == 3 and batch.num_prefill_tokens == 0 and not batch.rows[2].chunk.needs_logits


def test_a_decoding_sequence_keeps_its_row_from_step_to_step_and_gets_a_new_one_when_swapped_in():
    # A 5-block pool: the older request's 30 + 1 tokens and the newer's 20 + 1 take 4; both decode.
    scheduler = make_scheduler(5, "swap")
    bm = scheduler.block_manager
    older = run(scheduler, make_request(0, list(range(3, 33)), [[5]], max_tokens=40))
    newer = run(scheduler, make_request(1, list(range(40, 60)), [[6]], max_tokens=40))
    seq = newer.seqs[0]
    batch = scheduler.schedule()
    row = batch.rows[1]
    assert row.seq is seq and row.chunk.start_pos == 20
    sample(scheduler, batch)
    batch = scheduler.schedule()
    assert batch.rows[1] is row and row.chunk.start_pos == 21 and row.chunk.token_ids == [9]
    sample(scheduler, batch)
    # The older request's next token needs a block and none is left: the newer is swapped out.
    bm.allocate(10**6, [1] * 16)
    batch = scheduler.schedule()
    assert batch.preempted == [newer] and [r.seq for r in batch.rows] == [older.seqs[0]]
    sample(scheduler, batch)
    bm.free(10**6)
    scheduler.finish(older)
    batch = scheduler.schedule()  # swapped in; it decodes from the next step
    assert newer.state is RequestState.RUNNING and batch.step_input.swap_in and not batch.rows
    batch = scheduler.schedule()
    assert [r.seq for r in batch.rows] == [seq] and batch.rows[0] is not row
    # Its new row reads the block table the swap-in made, not the one it had before.
    assert batch.rows[0].chunk.block_table is bm.live_block_table(seq.seq_id) is not row.chunk.block_table


def test_a_finished_request_drops_its_sequences_rows():
    # Each row refers back to its sequence: the cycle is broken when the request leaves, so its objects
    # go when the last reference does, not at the next full collection.
    scheduler = make_scheduler(16)
    request = run(scheduler, make_request(0, list(range(3, 23)), [[5], [6]]))
    batch = scheduler.schedule()
    assert [row.seq.decode_row for row in batch.rows] == batch.rows
    scheduler.finish(request)
    assert [seq.decode_row for seq in request.seqs] == [None, None]
