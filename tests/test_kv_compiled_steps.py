"""CompressedCache decoding steps under torch.compile: one graph or a few, no recompilation, the numbers a step
takes, and the tokens of eager decoding (apart from tests/test_kv_decode_steps.py so that pytest-xdist can run the
two files side by side)."""

from __future__ import annotations

import pytest
import torch

from decodekit.cache import CompressedCache
from tests.decode_steps import decode_by_hand, prompt_batch
from tests.tiny import build_model


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


def _compiled_decoding(
    model, forward, cache, prompt: torch.Tensor, steps: int, warmup: int = 3, regions: set | None = None
) -> tuple[list[int], int, int]:
    """Greedy decoding of ``steps`` tokens through ``forward``; returns the tokens and the number of graphs
    dynamo had made after ``warmup`` steps and at the end. ``regions``, when given, receives the names of the
    compiled regions (graphs) the steps after ``warmup`` ran, as the profiler records them."""
    from torch._dynamo.utils import counters

    with torch.no_grad():
        token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
        tokens, graphs_after_warmup, profiler = [], 0, None
        for step in range(steps):
            if step == warmup:
                graphs_after_warmup = counters["stats"]["unique_graphs"]
                if regions is not None:
                    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    profiler.__enter__()
            position = torch.tensor([[prompt.shape[1] + step]], device=prompt.device)
            logits = forward(token, past_key_values=cache, position_ids=position, cache_position=position[0]).logits
            token = logits[:, -1:].argmax(dim=-1)
            tokens.append(int(token))
        if profiler is not None:
            profiler.__exit__(None, None, None)
            regions.update(event.name for event in profiler.events() if event.name.startswith("Torch-Compiled Region"))
    return tokens, graphs_after_warmup, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_decoding_has_one_graph_and_matches_eager(fresh, backend):
    """Under ``torch.compile(model.forward, fullgraph=True)`` (a graph break would raise), decoding with one
    eviction per step compiles one graph at the first step (the prompt's pass leaves the count of tokens seen on the
    device current, as the steps keep it) and never again over 200 steps, and picks the tokens eager decoding
    picks. Inductor writes each step's entries and evictions into the layers' tensors in place: its code allocates no
    tensor of a layer's keys or values' shape, nor of its storage's (a copy, written back, at every step)."""
    from torch._inductor.utils import run_and_get_code

    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]
    settings = {"budget": 48, "eviction_interval": 1}
    eager, _, _ = _compiled_decoding(model, model.forward, CompressedCache(model, **settings), prompt, steps=200)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cache = CompressedCache(model, **settings)
    forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    (compiled, after_warmup, at_end), codes = run_and_get_code(
        _compiled_decoding, model, forward, cache, prompt, steps=200
    )
    assert cache.kept_tokens == 48 and cache.get_seq_length() == prompt.shape[1] + 200  # every step evicted
    assert after_warmup == at_end == 1
    assert compiled == eager
    if backend == "inductor":
        assert len(codes) == 1
        shape = (1, model.config.num_key_value_heads, 49, model.config.head_dim)
        assert all(tuple(layer.storage.tensor(part).shape) == shape for layer in cache.layers
                   for part in ("keys", "values"))  # fmt: skip
        flat = (model.config.num_key_value_heads * 49 + 1, model.config.head_dim)  # the storage's flat tensors
        assert f"empty_strided_cpu({shape}" not in codes[0]
        assert f"empty_strided_cpu({flat}" not in codes[0]


def test_compiled_steps_of_coded_entries_decode_each_layer_once_and_write_in_place(fresh):
    """With keys and values coded in 4 bits, a compiled step (inductor) decodes each layer's keys and values for
    attention, and writes the step's exact entries into those decoded copies in place: its code allocates at most two
    tensors of a layer's decoded keys' shape per layer, for the keys and values decoded (a ``scatter_`` into a decoded
    copy made it anew, one more copy per write: four per layer), and its tokens are eager decoding's."""
    from torch._inductor.utils import run_and_get_code

    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]
    settings = {"budget": 48, "eviction_interval": 1, "kv_bits": 4}
    eager, _, _ = _compiled_decoding(model, model.forward, CompressedCache(model, **settings), prompt, steps=30)
    torch._dynamo.reset()
    cache = CompressedCache(model, **settings)
    forward = torch.compile(model.forward, backend="inductor", fullgraph=True)
    (compiled, _, _), codes = run_and_get_code(_compiled_decoding, model, forward, cache, prompt, steps=30)
    assert compiled == eager
    assert len(codes) == 1
    config = model.config
    decoded = f"empty_strided_cpu({(1, config.num_key_value_heads, 49, config.head_dim)}"
    assert codes[0].count(decoded) <= 2 * config.num_hidden_layers


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_decoding_at_the_default_interval_runs_three_graphs(fresh, backend):
    """With the default eviction interval (8 at this budget), a compiled step scores at once and evicts eight tokens
    branch-free when its row goes over the budget (an eager step's scoring waits for the next eviction instead, to
    the same scores), so that every step runs one graph: after the first interval dynamo makes no new graph over 200
    steps, at most four in all, the last intervals run at most three of them, and the tokens are eager decoding's."""
    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]
    interval = CompressedCache(model, budget=48).options.size.eviction_interval
    assert interval == 8
    eager, _, _ = _compiled_decoding(model, model.forward, CompressedCache(model, budget=48), prompt, steps=200)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cache = CompressedCache(model, budget=48)
    forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    regions = set()
    compiled, after_warmup, at_end = _compiled_decoding(
        model, forward, cache, prompt, 200, warmup=200 - 3 * interval, regions=regions
    )
    assert cache.get_seq_length() == prompt.shape[1] + 200 and cache.kept_tokens <= 48
    assert after_warmup == at_end <= 4
    assert compiled == eager
    assert 1 <= len(regions) <= 3, regions


class RecordingBackend:
    """A ``torch.compile`` backend that runs each graph as dynamo made it and records, for every call, which graph
    ran, the numbers (not tensors) it was given, and how many tensors it returned (numbers it returns, such as the
    layers' host-side counts, are no memory a CUDA graph would overwrite)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple, int]] = []
        self.graphs = 0
        self.reads = 0  # values read from tensors inside the graphs (``item``): a sync that CUDA graphs cannot hold

    def __deepcopy__(self, memo):  # (transformers' CompileConfig copies its options; the records must stay here)
        return self

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        index, self.graphs = self.graphs, self.graphs + 1
        reading = ("item", torch.ops.aten._local_scalar_dense.default)
        self.reads += sum(node.target in reading for node in graph.graph.nodes)

        def run(*args):
            numbers = tuple(value for value in args if not isinstance(value, torch.Tensor))
            result = graph.forward(*args)
            returned = sum(isinstance(value, torch.Tensor) for value in result)
            self.calls.append((index, numbers, returned))
            return result

        return run


@pytest.mark.parametrize(("budget", "kv_bits"), [("floor", None), (48, None), (48, 4), ("floor", 8), (48, 3)])
def test_compiled_steps_evicting_at_every_step_take_the_same_numbers_and_return_the_logits_alone(
    fresh, budget, kv_bits
):
    """CUDA graphs (``torch.compile(..., mode="reduce-overhead")``) record a graph anew for each new value of a number
    the graph takes, and a replay overwrites what the graph returned before. With one eviction per step and a fixed
    budget, every step runs one graph, given the same numbers at every step (the tokens seen are counted on the
    device inside compiled steps, from the count the prompt's pass left there; the freed slots written in place),
    which returns the logits alone;
    the host reads the count back after the steps, and the tokens are eager decoding's; down to a budget of the sinks
    and the recent window alone, and with keys and values coded in 3, 4 or 8 bits (whose rotated queries' matrix a step
    makes for all layers, kept eagerly but not from a compiled step, which would return it)."""
    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]
    if budget == "floor":
        budget = CompressedCache(model, budget=48).policy.floor
    settings = {"budget": budget, "eviction_interval": 1, "kv_bits": kv_bits}
    eager, _, _ = _compiled_decoding(model, model.forward, CompressedCache(model, **settings), prompt, steps=60)
    torch._dynamo.reset()
    backend = RecordingBackend()
    cache = CompressedCache(model, **settings)
    forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    compiled, _, _ = _compiled_decoding(model, forward, cache, prompt, steps=60)
    assert compiled == eager
    steady = backend.calls
    assert len(steady) == 60 and backend.graphs == 1
    assert len({graph for graph, _, _ in steady}) == 1
    assert len({numbers for _, numbers, _ in steady}) == 1
    assert {returned for _, _, returned in steady} == {1}
    assert backend.reads == 0  # no value read back inside a graph
    assert cache.get_seq_length() == prompt.shape[1] + 60
    assert [layer.seen for layer in cache.layers] == [prompt.shape[1] + 60] * len(cache.layers)


def _two_rows(tokenizer, padded: bool) -> dict[str, torch.Tensor]:
    """Two rows of the prompt, or (``padded``) it and its first half, left-padded; two unpadded rows differ in their
    last 20 tokens, so that swapping them changes what each decodes."""
    batch = prompt_batch(tokenizer, rows=2, padded=padded)
    if not padded:
        batch["input_ids"][1, -20:] = batch["input_ids"][1, -20:].flip(0)
    return batch


def _cuda_graphs_recorded() -> int:
    """How many CUDA graphs inductor's CUDA-graph trees have recorded on the current device."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    return int(repr(manager.graph_counter).removeprefix("count(").removesuffix(")"))


def _rows_by_hand(model, forward, cache, batch, steps: int, swap_after: int | None = None) -> torch.Tensor:
    """Greedy decoding of a batch by hand: the prompt's pass eager, then each step through ``forward`` with each row at
    its own position and no mask (as a compiled step is given); with ``swap_after``, the two rows are swapped after
    that step, as a beam search reorders them. Returns the tokens, ``[rows, steps]``."""
    positions = batch["attention_mask"].sum(dim=-1, keepdim=True)  # each row's next position
    device = positions.device
    with torch.no_grad():
        logits = model(**batch, past_key_values=cache).logits[:, -1]
        tokens = []
        for step in range(steps):
            token = logits.argmax(dim=-1, keepdim=True)
            tokens.append(token)
            column = torch.tensor([batch["input_ids"].shape[1] + step], device=device)
            logits = forward(token, past_key_values=cache, position_ids=positions, cache_position=column).logits
            logits, positions = logits[:, -1], positions + 1
            if step == swap_after:
                swap = torch.tensor([1, 0], device=device)
                cache.reorder_cache(swap)
                logits, positions = logits[swap], positions[swap]
    return torch.cat(tokens, dim=-1)


@pytest.mark.parametrize(
    ("spare", "kv_bits", "padded"),
    [
        (0, None, False), (1, None, False), (14, None, False), (80, None, False), (14, 4, False), (14, None, True),
        (0, None, True), (-40, None, True), (-40, 4, True),
    ],
)  # fmt: skip
def test_compiled_steps_filling_a_budget_longer_than_the_prompt_take_the_same_numbers(fresh, spare, kv_bits, padded):
    """With a prompt shorter than the budget, the prompt's pass makes the room for the whole budget (``budget + 1``
    slots, as StaticCache makes ``max_cache_len``), the steps fill it and then evict one token each: past the first
    two compiled steps one graph runs, given the same numbers at every step (each segment's length is counted on the
    device) and returning the logits alone, through the step that fills the budget and the evictions after it; the
    tokens are eager decoding's, and the host's counts, read after the steps, are the kept entries. ``spare``: the
    budget's slots the prompt leaves unfilled (0: none, the prompt fills the budget; 1: the room holds one dead slot
    besides the freed one; 80: more than the steps fill, so no step evicts); with keys and values in 4 bits too, and
    for a left-padded batch (whose second row holds half the tokens, so that it fills up even where the first fills
    the budget, or overflows it: -40, a budget between the rows' lengths, where the prompt's eviction leaves the
    second row fewer dead slots than its padding)."""
    model, tokenizer = fresh
    batch = prompt_batch(tokenizer, rows=2, padded=padded)
    prompt = batch["input_ids"]
    settings = {"budget": prompt.shape[1] + spare, "eviction_interval": 1, "kv_bits": kv_bits}
    steps = 60
    eager_cache = CompressedCache(model, **settings)
    eager = decode_by_hand(model, eager_cache, batch, steps)
    torch._dynamo.reset()
    backend = RecordingBackend()
    cache = CompressedCache(model, **settings)
    forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    compiled = _rows_by_hand(model, forward, cache, batch, steps)
    assert torch.equal(compiled, torch.cat(eager, dim=-1))
    layer = cache.layers[0]
    assert layer.storage.capacity == settings["budget"] + 1  # the room for the whole budget, made by the prompt's pass
    steady = backend.calls[2:]
    assert len({graph for graph, _, _ in steady}) == 1
    assert len({numbers for _, numbers, _ in steady}) == 1
    assert {returned for _, _, returned in steady} == {1}
    assert backend.reads == 0
    kept = [min(length + steps, settings["budget"]) for length in batch["attention_mask"].sum(dim=-1).tolist()]
    assert [layer.storage.length_range for layer in cache.layers] == [(min(kept), max(kept))] * len(cache.layers)
    assert [layer.storage.length_range for layer in eager_cache.layers] == [(min(kept), max(kept))] * len(cache.layers)
    assert cache.kept_tokens == eager_cache.kept_tokens
    # The same tokens kept, wherever their slots: eager steps append into the room, compiled ones opened it (and
    # fill a padded row's padding slots first).
    for ours, theirs in zip(cache.layers, eager_cache.layers, strict=True):
        assert torch.equal(ours.kept_positions(), theirs.kept_positions())


@pytest.mark.parametrize(("padded", "budget"), [(False, 48), (False, 200), (True, 146)])
def test_rows_reordered_between_compiled_steps_decode_as_eagerly(fresh, padded, budget):
    """Rows reordered between compiled steps (as a beam search by hand reorders them: transformers' own beam search
    runs its steps uncompiled) decode as eager steps do, over a prompt longer than the budget, under a budget longer
    than the prompt while the rows fill its room (their live entries counted on the device), and for a left-padded
    batch under a budget between its rows' lengths. A reorder costs one graph more at most (the step after it takes
    its storage rebuilt), and the steps after it settle on one graph."""
    model, tokenizer = fresh
    batch = _two_rows(tokenizer, padded)
    settings = {"budget": budget, "eviction_interval": 1}
    torch._dynamo.reset()
    backend = RecordingBackend()
    compiled_forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    runs = []
    for forward in (model.forward, compiled_forward):
        cache = CompressedCache(model, **settings)
        tokens = _rows_by_hand(model, forward, cache, batch, 40, swap_after=20)
        runs.append((tokens, [layer.kept_positions() for layer in cache.layers]))
    (eager, eager_kept), (compiled, compiled_kept) = runs
    assert torch.equal(compiled, eager)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(compiled_kept, eager_kept, strict=True))
    graphs = [graph for graph, _, _ in backend.calls]
    assert len(graphs) == 40 and len(set(graphs[2:21])) == 1 and len(set(graphs[23:])) == 1 and max(graphs) <= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(("kv_bits", "budget"), [(None, 48), (4, 48), (None, 200)])
def test_cuda_graphs_replay_compiled_steps_evicting_at_every_step(tiny, kv_bits, budget):
    """On CUDA, ``torch.compile(mode="reduce-overhead")`` captures the steps of a cache that evicts one token per step
    in CUDA graphs: none is skipped (the tensors the steps write into are marked as static addresses), graphs are
    recorded for the first steps only, not one per step, and the tokens are eager decoding's; with keys and values
    in 4 bits too, and under a budget longer than the 186-token prompt, which the steps fill."""
    from torch._dynamo.utils import counters

    _, tokenizer = tiny
    model = build_model(tokenizer).cuda()
    prompt = prompt_batch(tokenizer)["input_ids"].cuda()
    settings = {"budget": budget, "eviction_interval": 1, "kv_bits": kv_bits}
    eager, _, _ = _compiled_decoding(model, model.forward, CompressedCache(model, **settings), prompt, steps=40)
    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    compiled, _, _ = _compiled_decoding(model, forward, CompressedCache(model, **settings), prompt, steps=40)
    recorded = _cuda_graphs_recorded()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert 1 <= recorded <= 4
    assert compiled == eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(("padded", "budget"), [(False, 48), (False, 200), (True, 146)])
def test_cuda_graphs_replay_compiled_steps_after_rows_are_reordered(tiny, padded, budget):
    """On CUDA, rows reordered between steps captured in CUDA graphs (a beam search's reorder rebuilds the room the
    steps write into) decode as eager steps do: no graph is skipped for mutated inputs (the rebuilt room is marked
    as a static address too), and a few graphs are recorded, not one per step."""
    from torch._dynamo.utils import counters

    _, tokenizer = tiny
    model = build_model(tokenizer).cuda()
    batch = {name: tensor.cuda() for name, tensor in _two_rows(tokenizer, padded).items()}
    settings = {"budget": budget, "eviction_interval": 1}
    eager = _rows_by_hand(model, model.forward, CompressedCache(model, **settings), batch, 40, swap_after=20)
    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    compiled = _rows_by_hand(model, forward, CompressedCache(model, **settings), batch, 40, swap_after=20)
    recorded = _cuda_graphs_recorded()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert 1 <= recorded <= 6
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize(
    ("padded", "kv_bits", "budget", "graphs"),
    [
        (False, None, 48, 1), (True, None, 48, 1), (False, 4, 48, 1), (False, None, 200, 2), (False, 4, 200, 2),
        (True, None, 200, 2), (False, None, 186, 1), (True, None, 186, 1), (True, None, 146, 1),
    ],
)  # fmt: skip
def test_generate_compiles_the_steps_of_a_cache_evicting_at_every_step(
    fresh, monkeypatch, padded, kv_bits, budget, graphs
):
    """``model.generate(..., compile_config=...)`` compiles the decoding steps of a cache that evicts one token per
    step under a budget in tokens (it reports itself compileable, as a StaticCache does): no graph break, the steps
    given the same numbers and returning the logits alone, and the tokens of eager ``generate``, for one row and a
    padded batch, for one row with keys and values in 4 bits, and under a budget longer than the 186-token prompt,
    which the steps fill (the live entries counted on the device: generate's own preparation of each step reads no
    count back), or as long as it, or between a padded batch's rows' lengths, where only its shorter row fills up.
    Every step runs one graph (the prompt's pass leaves the device's count of tokens seen current; a padded batch's
    first step searches for its dead slot, as its later steps do), but where the first step opens the room the steps
    fill (a budget longer than the prompt), which costs that step a graph of its own (at most)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, tokenizer = fresh
    batch = prompt_batch(tokenizer, padded=padded)
    settings = {"budget": budget, "eviction_interval": 1, "kv_bits": kv_bits}
    greedy = {"max_new_tokens": 60, "do_sample": False}
    assert CompressedCache(model, **settings).is_compileable
    eager = model.generate(**batch, past_key_values=CompressedCache(model, **settings), disable_compile=True, **greedy)
    torch._dynamo.reset()
    counters.clear()
    backend = RecordingBackend()
    config = CompileConfig(backend=backend, mode=None, fullgraph=True)
    config._compile_all_devices = True  # (generate compiles on accelerators only, unless told)
    cache = CompressedCache(model, **settings)
    compiled = model.generate(**batch, past_key_values=cache, compile_config=config, **greedy)
    shortest = int(batch["attention_mask"].sum(dim=-1).min())
    assert batch["input_ids"].shape[1] == 186 and shortest == (93 if padded else 186)
    assert torch.equal(compiled, eager)
    assert len(backend.calls) == 59 and backend.graphs <= graphs  # every step but the prompt's pass, compiled
    assert not counters["graph_break"]
    steady = backend.calls[backend.graphs - 1 :]  # the steps that run the last graph: all of them where there is one
    assert {graph for graph, _, _ in steady} == {backend.graphs - 1}
    assert len({numbers for _, numbers, _ in steady}) == 1
    assert {returned for _, _, returned in backend.calls} == {1}
    assert backend.reads == 0


def test_only_one_eviction_per_step_under_a_token_budget_is_compileable(fresh):
    """``generate`` compiles a cache only where it reports itself compileable: at longer intervals, and under targets
    that grow with the tokens seen, a step's graph takes numbers that change from step to step."""
    model, _ = fresh
    assert CompressedCache(model, budget=48, eviction_interval=1).is_compileable
    assert CompressedCache(model, budget=48, eviction_interval=1, kv_bits=8).is_compileable
    assert not CompressedCache(model, budget=48).is_compileable
    assert not CompressedCache(model, budget=48, eviction_interval=2).is_compileable
    assert not CompressedCache(model, compression_ratio=0.5, eviction_interval=1).is_compileable
    assert not CompressedCache(model, memory_fraction=0.25).is_compileable


def test_compiled_steps_without_positions_take_them_from_the_count_on_the_device(fresh):
    """A compiled step called without positions (the model derives them from ``get_seq_length``, which inside the
    step is the count held on the device, as transformers' StaticLayer returns its own) compiles to one graph without
    a graph break and without reading the count back inside it, and decodes eager decoding's tokens."""
    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]

    def decode(forward) -> tuple[list[int], int]:
        cache, tokens = CompressedCache(model, budget=48, eviction_interval=1), []
        with torch.no_grad():
            token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
            for _ in range(40):
                token = forward(token, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
                tokens.append(int(token))
        return tokens, cache.get_seq_length()

    eager = decode(model.forward)
    torch._dynamo.reset()
    backend = RecordingBackend()
    assert decode(torch.compile(model.forward, backend=backend, fullgraph=True)) == eager
    assert eager[1] == prompt.shape[1] + 40
    assert backend.graphs == 1 and backend.reads == 0


def test_compiled_steps_after_a_crop_return_the_logits_alone(fresh):
    """A crop between compiled steps (as assisted generation makes) shortens the segments: with one eviction per step
    under a budget in tokens the storage keeps its ``budget + 1`` slots and the next steps fill them again. No step
    returns a tensor the cache then holds (a CUDA graph overwrites what it returned when it runs again), and the tokens
    are eager decoding's."""
    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]

    def decode(forward) -> tuple[list[int], list[int]]:
        cache, tokens, slots = CompressedCache(model, budget=48, eviction_interval=1), [], []
        with torch.no_grad():
            token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
            for step in range(30):
                if step == 12:  # forget the last two tokens and feed them again
                    cache.crop(-2)
                    for again in tokens[-2:]:
                        forward(torch.tensor([[again]]), past_key_values=cache)
                token = forward(token, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
                tokens.append(int(token))
                slots.append(cache.layers[0].storage.capacity)
        return tokens, slots

    eager, slots = decode(model.forward)
    assert set(slots) == {49}
    torch._dynamo.reset()
    backend = RecordingBackend()
    assert decode(torch.compile(model.forward, backend=backend, fullgraph=True))[0] == eager
    assert {returned for _, _, returned in backend.calls} == {1}


def test_compiled_and_eager_steps_evicting_at_every_step_keep_one_count(fresh):
    """Eager steps count the tokens seen on the host, compiled ones on the device: a decoding that switches between
    the two (the host reading the count between them) keeps one count, with eager decoding's tokens, positions and
    scores."""
    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]
    settings = {"budget": 40, "eviction_interval": 1}
    compiled_forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    chosen = {2, 3, 4, 5, 9, 20, 21, 22, 23, 24, 25, 30, 31}  # the steps that run compiled

    def decode(cache, mixed: bool) -> list[int]:
        tokens = []
        with torch.no_grad():
            token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
            for step in range(36):
                forward = compiled_forward if mixed and step in chosen else model.forward
                length = cache.get_seq_length() if step in (10, 26) else None  # the host reads the count back
                position = torch.tensor([[length if length is not None else prompt.shape[1] + len(tokens)]])
                logits = forward(token, past_key_values=cache, position_ids=position, cache_position=position[0])
                token = logits.logits[:, -1:].argmax(dim=-1)
                tokens.append(int(token))
        return tokens

    reference = CompressedCache(model, **settings)
    eager = decode(reference, mixed=False)
    torch._dynamo.reset()
    cache = CompressedCache(model, **settings)
    assert decode(cache, mixed=True) == eager
    assert cache.get_seq_length() == reference.get_seq_length() == prompt.shape[1] + 36
    for layer, expected in zip(cache.layers, reference.layers, strict=True):
        # The same entries with the same scores, in position order (slot order is free).
        mine, theirs = layer.positions().sort(dim=-1), expected.positions().sort(dim=-1)
        assert torch.equal(mine.values, theirs.values)
        torch.testing.assert_close(layer.scores().gather(2, mine.indices), expected.scores().gather(2, theirs.indices))


def test_decoding_switching_between_compiled_and_eager_steps_between_evictions_matches_eager(fresh):
    """Eager steps between evictions wait for their scoring; a compiled step scores the steps waiting before it, then
    its own, at once: a decoding that switches between the two within an interval (and one that compiles only some
    intervals) scores the steps in their order, as eager decoding does (same tokens, the same entries with the same
    scores)."""
    model, tokenizer = fresh
    prompt = prompt_batch(tokenizer)["input_ids"]
    reference = CompressedCache(model, budget=48)
    eager, _, _ = _compiled_decoding(model, model.forward, reference, prompt, steps=60)
    torch._dynamo.reset()
    compiled_forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    switches = iter([3, 4, 5, 11, 12, 19, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 50])  # steps that run compiled
    chosen = set(switches)
    step = 0

    def forward(*args, **kwargs):
        nonlocal step
        step += 1
        return (compiled_forward if step - 1 in chosen else model.forward)(*args, **kwargs)

    cache = CompressedCache(model, budget=48)
    mixed, _, _ = _compiled_decoding(model, forward, cache, prompt, steps=60)
    assert mixed == eager
    for layer, expected in zip(cache.layers, reference.layers, strict=True):
        # The same entries with the same scores, in position order (slot order is free).
        mine, theirs = layer.positions().sort(dim=-1), expected.positions().sort(dim=-1)
        assert torch.equal(mine.values, theirs.values)
        torch.testing.assert_close(layer.scores().gather(2, mine.indices), expected.scores().gather(2, theirs.indices))
