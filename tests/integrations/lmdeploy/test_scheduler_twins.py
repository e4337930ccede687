"""lmdeploy's real Scheduler (0.16.0 wheel) with hybridcache's adapter installed behaves exactly
as with lmdeploy's own trie: same hits, same block tables and reference counts, same blocks
and state rows freed, step by step, with hybridcache's invariants checked after every step."""

from tests.integrations.lmdeploy.twins import BLOCK, Twins, image, waiting


def _serve(twins: Twins, name: str, session: int, tokens: list[int], **kw) -> dict:
    twins.step(lambda w: w.add(name, session, tokens, **kw))
    observed = twins.step(lambda w: w.schedule())
    assert name in observed["running"]
    twins.step(lambda w: w.forward())
    return observed


def _publish_now(world, name: str) -> None:
    """A checkpoint of the whole prompt, saved outside a schedule (lmdeploy's tests do this)."""
    seq = world.seqs[name]
    world.scheduler.block_manager.allocate(seq)
    world.scheduler.block_trie.allocate(seq)
    assert world.scheduler.block_trie.state_checkpoints.reserve_save(seq) >= 0
    assert world.scheduler.block_trie.state_checkpoints.publish_save(seq)


def _pin_checkpoint_of(world, name: str) -> None:
    """Another forward holds the checkpoint (lmdeploy's tests pin through the field)."""
    world.pinned = world.seqs[name].prefix_cache.trie_cursor
    world.pinned.state_checkpoint.pin_count = 1


def _unpin(world) -> None:
    world.pinned.state_checkpoint.pin_count = 0


def test_attention_prefix_hit_shares_blocks_with_one_reference_per_holder():
    twins = Twins(ssm=False, num_gpu_blocks=32)
    _serve(twins, "a", 0, [1] * (3 * BLOCK) + [5])
    observed = _serve(twins, "b", 1, [1] * (3 * BLOCK) + [6])
    b = observed["seqs"]["b"]
    assert b["step"] == 3 * BLOCK and observed["hits"] == 3 * BLOCK
    assert b["refs"][:3] == [3, 3, 3]  # the trie, a and b
    twins.step(lambda w: w.finish("a"))
    after = twins.step(lambda w: w.finish("b"))
    assert after["free_gpu"] == 32 - 3  # only the trie's three shared blocks stay


def test_multi_turn_ssm_sessions_resume_from_the_previous_turns_checkpoint():
    """Turn 2 resumes at turn 1's mid-block checkpoint exactly as with lmdeploy's trie. After
    that partial hit lmdeploy keeps turn 2's complete blocks out of the trie, so turn 2's own
    prompt-end save finds no anchor and turn 3 falls back to turn 1's checkpoint; hybridcache
    attaches them and turn 3 resumes at turn 2's prompt end."""
    twins = Twins(ssm=True, num_gpu_blocks=64)
    first = [1] * (2 * BLOCK + 8)
    second = first + [7] + [2] * 20
    third = second + [7] + [3] * 40
    _serve(twins, "t1", 0, first)
    reference, subject = _serve_both(twins, "t2", 0, second)
    assert reference["seqs"]["t2"]["step"] == subject["seqs"]["t2"]["step"] == len(first)
    assert reference["hits"] == subject["hits"] == len(first)
    reference, subject = _serve_both(twins, "t3", 0, third)
    assert reference["seqs"]["t3"]["step"] == len(first)
    assert subject["seqs"]["t3"]["step"] == len(second)
    assert subject["seqs"]["t3"]["restore"] >= 0


def _serve_both(twins: Twins, name: str, session: int, tokens: list[int]) -> tuple[dict, dict]:
    twins.step_both(lambda w: w.add(name, session, tokens))
    observed = twins.step_both(lambda w: w.schedule())
    twins.step_both(lambda w: w.forward())
    return observed


def test_a_refused_ssm_admission_rolls_back_exactly_and_is_admitted_later():
    twins = Twins(ssm=True, num_gpu_blocks=16, max_batches=1, state_budget=0)
    twins.step(lambda w: w.add("cached", 0, [1] * (2 * BLOCK)))
    twins.step(lambda w: _publish_now(w, "cached"))
    twins.step(lambda w: _pin_checkpoint_of(w, "cached"))
    twins.step(lambda w: w.add("hit", 1, [1] * (2 * BLOCK) + [2]))
    refused = twins.step(lambda w: w.schedule())
    assert refused["running"] == [] and waiting(refused, "hit") and waiting(refused, "cached")
    for name in ("hit", "cached"):  # each tentative match was taken back: no step, no block
        assert refused["seqs"][name]["step"] == 0 and refused["seqs"][name]["blocks"] == []
    assert refused["free_gpu"] == 16 - 2 and refused["checkpoint_states"] == 1  # what the trie keeps
    assert refused["hits"] == 0 and refused["queries"] == 0  # the matches' stats rolled back
    twins.step(_unpin)
    admitted = twins.step(lambda w: w.schedule())
    # one state row: the running sequence's state takes it back from the unpinned checkpoint
    assert admitted["running"] == ["cached"] and admitted["checkpoint_states"] == 0
    twins.step(lambda w: w.forward())
    twins.step(lambda w: w.finish("cached"))
    later = twins.step(lambda w: w.schedule())
    assert later["running"] == ["hit"] and later["seqs"]["hit"]["step"] == 0


def test_eviction_under_pressure_frees_the_same_cached_blocks():
    twins = Twins(ssm=False, num_gpu_blocks=8)
    _serve(twins, "old", 0, [1] * (4 * BLOCK) + [2])
    twins.step(lambda w: w.finish("old"))
    observed = _serve(twins, "new", 1, [3] * (6 * BLOCK) + [4])
    assert observed["seqs"]["new"]["step"] == 0 and len(observed["seqs"]["new"]["blocks"]) == 7
    again = _serve(twins, "again", 2, [1] * (4 * BLOCK) + [2])
    assert again["seqs"]["again"]["step"] < 4 * BLOCK  # part of the old prefix was evicted


def test_multimodal_identity_shares_only_the_same_image():
    twins = Twins(ssm=False, num_gpu_blocks=32)
    tokens = [1] * BLOCK + [99] * BLOCK + [1] * BLOCK + [5]
    _serve(twins, "cat", 0, tokens, multimodals=image(BLOCK, 2 * BLOCK, "cat"))
    same = _serve(twins, "cat2", 1, tokens, multimodals=image(BLOCK, 2 * BLOCK, "cat"))
    assert same["seqs"]["cat2"]["step"] == 3 * BLOCK
    other = _serve(twins, "dog", 2, tokens, multimodals=image(BLOCK, 2 * BLOCK, "dog"))
    assert other["seqs"]["dog"]["step"] == BLOCK  # the text block before the image only


def test_recompute_overlap_keeps_the_dropped_suffix_private():
    twins = Twins(ssm=False, num_gpu_blocks=32)
    cached = _serve(twins, "cached", 0, [1] * (4 * BLOCK) + [2])
    observed = _serve(twins, "mtp", 1, [1] * (4 * BLOCK) + [3], recompute_blocks=1)
    mtp = observed["seqs"]["mtp"]
    assert mtp["step"] == 3 * BLOCK  # one cached block recomputed
    assert mtp["blocks"][3] != cached["seqs"]["cached"]["blocks"][3] and mtp["refs"][3] == 1


def test_an_overlap_block_evicted_before_the_allocate_stays_private_as_on_lmdeploy():
    """The match finds both cached blocks and recomputes them (recompute_blocks=2), so it holds
    neither; making room for its three blocks evicts the cached second block. lmdeploy's
    allocate stops at that lost overlap block: the request's fresh block there (and after it)
    stays private until its forward ran, and joins the trie at the next allocate. The adapter
    attached it at once (2 references instead of 1) and then failed to schedule the next turn."""
    twins = Twins(ssm=False, num_gpu_blocks=4)
    prefix = [1] * (2 * BLOCK)
    _serve(twins, "cached", 0, prefix + [2])
    freed = twins.step(lambda w: w.finish("cached"))
    assert freed["free_gpu"] == 2  # the trie's two blocks, held by nobody
    observed = _serve(twins, "mtp", 1, prefix + [3], recompute_blocks=2)
    mtp = observed["seqs"]["mtp"]
    assert mtp["step"] == 0 and observed["free_gpu"] == 0
    assert mtp["refs"] == [1, 1, 1]  # the first private block maps to the trie's; none is shared
    twins.step(lambda w: w.continue_turn("mtp", [5] * BLOCK))
    observed = twins.step(lambda w: w.schedule())
    assert observed["seqs"]["mtp"]["refs"] == [2, 2, 2, 1]  # computed now: all three in the trie
    twins.step(lambda w: w.forward())
    twins.step(lambda w: w.add("again", 2, prefix + [4]))
    twins.step(lambda w: w.finish("mtp"))
    again = twins.step(lambda w: w.schedule())
    assert again["seqs"]["again"]["step"] == 2 * BLOCK and again["hits"] == 2 * BLOCK


def test_routed_experts_are_replayed_for_a_hit():
    twins = Twins(ssm=False, num_gpu_blocks=32)
    _serve(twins, "first", 0, [1] * (2 * BLOCK) + [2], experts=True)
    observed = _serve(twins, "replay", 1, [1] * (2 * BLOCK) + [3], experts=True)
    replay = observed["seqs"]["replay"]
    assert replay["step"] == 2 * BLOCK
    assert len(replay["experts"]) >= 2 * BLOCK  # replayed rows, then the forward's own



def _continue_both(twins: Twins, name: str, tokens: list[int]) -> tuple[dict, dict]:
    twins.step_both(lambda w: w.continue_turn(name, tokens))
    observed = twins.step_both(lambda w: w.schedule())
    twins.step_both(lambda w: w.forward())
    return observed


def test_a_continued_ssm_sequence_restores_from_its_checkpoint_as_lmdeploy_does():
    """lmdeploy's engine continues a session by growing its one sequence (update_token_ids in
    INPUTS mode, then activate), and its match searches checkpoints from the sequence's cursor,
    not from its computed step: turn 2 restores the state turn 1 published at its mid-block end,
    with the same hit, step, restore and table on both tries. Then the first deliberate
    difference (docs/integrations.md): lmdeploy keeps turn 2's completed block out of the trie,
    its save at turn 2's end finds no anchor and turn 3 rolls back to turn 1's checkpoint;
    hybridcache attached that block, so turn 3 resumes at turn 2's end."""
    twins = Twins(ssm=True, num_gpu_blocks=64)
    _serve(twins, "s", 0, [1] * (2 * BLOCK + 8))
    reference, subject = _continue_both(twins, "s", [7] + [2] * 20)
    ours, theirs = subject["seqs"]["s"], reference["seqs"]["s"]
    assert subject["hits"] == reference["hits"] == 8  # from the cursor at 32 to the checkpoint at 40
    for seen in ("step", "restore", "blocks", "tokens", "status"):
        assert ours[seen] == theirs[seen]
    assert ours["step"] == 2 * BLOCK + 8 and ours["restore"] >= 0
    assert theirs["refs"] == [2, 2, 1, 1] and ours["refs"] == [2, 2, 2, 1]  # block 2 joined our trie
    reference, subject = _continue_both(twins, "s", [7] + [3] * 40)
    assert reference["seqs"]["s"]["step"] == 2 * BLOCK + 8
    assert subject["seqs"]["s"]["step"] == 2 * BLOCK + 8 + 22 and subject["seqs"]["s"]["restore"] >= 0
    twins.step_both(lambda w: w.finish("s"))


def test_a_mid_block_checkpoint_replays_routed_experts_where_lmdeploy_recomputes():
    """The fourth deliberate difference (docs/integrations.md): lmdeploy refuses a partial
    (mid-block) checkpoint to a request that wants routed experts, since its trie keeps experts
    per complete block only; hybridcache keeps the checkpoint's tail rows with it, so the hit
    stands and replays every row up to the checkpoint."""
    twins = Twins(ssm=True, num_gpu_blocks=64)
    prompt = [1] * (2 * BLOCK + 8)
    first = twins.step(lambda w: w.add("a", 0, prompt, experts=True))
    twins.step(lambda w: w.schedule())
    computed = twins.step(lambda w: w.forward())["seqs"]["a"]["experts"]
    assert first["seqs"]["a"]["step"] == 0 and len(computed) == len(prompt)
    twins.step_both(lambda w: w.add("b", 1, prompt + [5] * 10, experts=True))
    reference, subject = twins.step_both(lambda w: w.schedule())
    theirs, ours = reference["seqs"]["b"], subject["seqs"]["b"]
    assert theirs["step"] == 0 and theirs["restore"] == -1 and theirs["experts"] == []
    assert ours["step"] == len(prompt) and ours["restore"] >= 0 and ours["experts"] == computed


def test_an_allocate_with_no_block_to_complete_returns_before_syncing_the_shadow():
    """A decode step's allocate inside a block (nothing completes beyond the cursor) returns at
    once on both tries, before the adapter syncs its shadow; the tables, counts and the next
    allocation that does complete a block still agree."""
    twins = Twins(ssm=False, num_gpu_blocks=32)
    twins.step(lambda w: w.add("a", 0, [1] * (3 * BLOCK + 1)))
    twins.step(lambda w: w.schedule())
    syncs = []

    def allocate_again(world) -> None:  # what a decode step's allocate inside the block does
        trie = world.scheduler.block_trie
        shadows = getattr(trie, "_shadows", None)
        if shadows is not None:  # the adapter: count its shadow syncs during the call only
            real_synced = shadows.synced
            shadows.synced = lambda seq, **kw: syncs.append(seq) or real_synced(seq, **kw)
        try:
            trie.allocate(world.seqs["a"])
        finally:
            if shadows is not None:
                del shadows.synced

    again = twins.step(allocate_again)
    assert syncs == [] and again["seqs"]["a"]["refs"] == [2, 2, 2, 1]
    twins.step(lambda w: w.forward())
    done = twins.step(lambda w: w.finish("a"))
    assert done["free_gpu"] == 32 - 3


def test_a_hit_longer_than_lmdeploys_table_growth_unit_keeps_the_same_table_as_it_grows():
    """The adapter writes a matched path into a fresh table buffer instead of lmdeploy's
    regrowing append: a hit of more blocks than lmdeploy grows a table by at once
    (``LogicalTokenBlocks.ALLOC_SIZE``), its suffix block and a next turn's blocks land at the
    same positions with the same counts on both tries."""
    from lmdeploy.pytorch.block import LogicalTokenBlocks

    blocks = LogicalTokenBlocks.ALLOC_SIZE + 3
    num_gpu_blocks = 2 * blocks + 16
    twins = Twins(ssm=True, num_gpu_blocks=num_gpu_blocks)
    prompt = [(i % 97) + 1 for i in range(blocks * BLOCK)]
    _serve(twins, "first", 0, prompt)
    twins.step(lambda w: w.finish("first"))
    observed = _serve(twins, "again", 1, prompt + [5] * BLOCK)
    again = observed["seqs"]["again"]
    assert again["step"] == observed["hits"] == blocks * BLOCK
    assert len(again["blocks"]) == blocks + 1 and again["refs"] == [2] * (blocks + 1)  # the trie's and its own
    twins.step(lambda w: w.continue_turn("again", [6] * (2 * BLOCK - 1)))  # the sampled token, then two blocks
    grown = twins.step(lambda w: w.schedule())
    assert "again" in grown["running"] and len(grown["seqs"]["again"]["blocks"]) == blocks + 3
    twins.step(lambda w: w.forward())
    done = twins.step(lambda w: w.finish("again"))
    assert done["free_gpu"] == num_gpu_blocks - (blocks + 3)  # the trie keeps every complete block


def test_a_save_at_a_pinned_anchor_is_refused_as_lmdeploy_refuses_it():
    """An aligned hit whose prompt ends mid-block: the hit pins the checkpoint at the anchor
    (the prompt's last complete block) for its restore, and lmdeploy refuses the forward's save
    at the prompt end, since a pinned checkpoint cannot be replaced, so it allocates no frozen
    copy of the partial block. The adapter refuses it too: the same blocks and state rows stay
    held after the forward, after the finish, and a later request hits the same checkpoint."""
    twins = Twins(ssm=True, num_gpu_blocks=24)
    prompt = [(i % 50) + 1 for i in range(4 * BLOCK)]
    _serve(twins, "aligned", 0, prompt)
    twins.step(lambda w: w.finish("aligned"))
    hit = _serve(twins, "partial", 1, prompt + [5] * 8)  # five blocks, the last one partial
    assert hit["seqs"]["partial"]["step"] == hit["hits"] == 4 * BLOCK
    assert hit["seqs"]["partial"]["restore"] >= 0
    forwarded = twins.step(lambda w: None)
    assert forwarded["free_gpu"] == 24 - 5 and forwarded["checkpoint_states"] == 1
    done = twins.step(lambda w: w.finish("partial"))
    assert done["free_gpu"] == 24 - 4  # the trie's four blocks; no frozen copy of the fifth
    again = _serve(twins, "again", 2, prompt + [5] * 8)
    assert again["seqs"]["again"]["step"] == 4 * BLOCK and again["hits"] == 8 * BLOCK


def test_a_save_at_an_anchors_checkpoint_step_is_refused_whatever_its_tail():
    """Two prompts share four blocks and end 8 tokens later with different tails: lmdeploy
    refuses the second one's save at the same step of the same anchor (one checkpoint per
    anchor, never replaced at its own step), so the first tail's checkpoint and frozen block
    stay and a later request with the first tail hits it. The adapter refuses it too."""
    twins = Twins(ssm=True, num_gpu_blocks=24)
    shared = [(i % 50) + 1 for i in range(4 * BLOCK)]
    _serve(twins, "first", 0, shared + [5] * 8)
    twins.step(lambda w: w.finish("first"))
    _serve(twins, "other", 1, shared + [6] * 8)
    kept = twins.step(lambda w: w.finish("other"))
    assert kept["free_gpu"] == 24 - 5 and kept["checkpoint_states"] == 1  # four blocks and one frozen copy
    hit = _serve(twins, "again", 2, shared + [5] * 8 + [7] * 4)
    assert hit["seqs"]["again"]["step"] == hit["hits"] == 4 * BLOCK + 8
