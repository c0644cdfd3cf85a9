"""Slots: one KV row per answer, each answer at its own length (no left padding, no splicing, no holes).

HF's caches keep one write position for the whole batch, so every row must end at the same column:
a row that joins late is padded on the left, and a row that waits for the LLM would need a hole. A
``SlotCache`` keeps, per layer, keys and values for ``slots`` rows of ``capacity`` columns, where
column ``c`` of a row holds that row's token at position ``c``. Each forward names the rows it
reads and where each one starts, so rows advance independently:

* a forward reads a piece of new tokens per row, **right-aligned**: row ``r``'s ``n_r`` tokens fill
  the last ``n_r`` columns of the ``[k, g]`` piece, so every row's last token is the piece's last
  column and the model's own ``logits_to_keep=1`` head (with whatever the architecture does after
  ``lm_head``) gives each row's next-token logits;
* the padding before them is written to one spare column past the capacity that nothing attends
  to, and its queries attend to column 0 only (finite values: no NaN can leak into real rows);
* a row's real token ``j`` sits at position ``start_r + j``: it attends to columns ``[0, start_r + j]``
  of its own row (one 4-D mask per forward, built on the device; sliding-window layers get a second).

Rows that are all the slots, or a contiguous range of them, read their keys and values in place; any
other subset is gathered (a copy of those rows' columns in use, counted by ``gathered_bytes``: on the host, from
the read's shapes, by whoever runs the read; nothing inside a read writes Python state, which a captured read's
replay would not run and a compiled one would guard on).

A recurrent layer's conv and recurrent states live beside the keys and values, one per slot (``slot_state.py``, which
says how they stay exact: no padding in a row, idle rows untouched, checkpoints for rollbacks).

Only the ``sdpa`` and ``eager`` attention paths take a prepared 4-D mask; a model's ``Abilities.slots``
(``core/abilities.py``) says why one cannot use slots (then the server decodes on HF's own caches).
"""

from __future__ import annotations

import torch

from ...compat import cache_argument
from ..features import HiddenStateCapture
from ..staging import in_order, staged
from .model_calls import layer_kinds
from .slot_state import CONV, RECURRENT, SlotStates

# Layer types whose attention is local, and the config entry that sizes it (HF's masks read the same entries).
LOCAL = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


class SlotCache:
    """Keys and values of ``slots`` rows x ``capacity`` columns per layer, allocated on the first write, and the
    recurrent layers' states per slot (``states``: ``slot_state.SlotStates``).

    HF's attention calls ``update(keys, values, layer_idx, ...)`` and attends over what it returns; its recurrent
    layers call ``get_conv_state`` / ``update_conv_state`` and their recurrent twins; ``plan`` says, before each
    forward, which rows it reads and where each new token goes, ``finish`` ends it.

    Args:
        layers: the model's decoder layers.
        slots: rows.
        capacity: columns per row (positions 0 .. capacity - 1); ``grow`` makes more.
        recurrent: the model has recurrent layers (its states are kept per slot, checkpointed for rollbacks).
    """

    is_compileable = False  # not HF's static cache: generate never sees it

    def __init__(self, layers: int, slots: int, capacity: int, recurrent: bool = False) -> None:
        self.recurrent = recurrent
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.rows: torch.Tensor | None = None  # [k] rows of this forward
        self.span: slice | None = None  # the same rows as a slice of the slots, when they are contiguous
        self.columns: torch.Tensor | None = None  # [k, g] the column each new token is written to
        self.used = 0  # columns the forward attends over
        self.gathered_bytes = 0
        self.states = SlotStates(slots)

    @property
    def trash(self) -> int:
        """The spare column padding is written to (past every position)."""
        return self.capacity

    def plan(self, rows: list[int] | None, columns: torch.Tensor, used: int, index: torch.Tensor | None = None,
             every_row_reads: bool = False) -> None:
        """The next forward reads ``rows``; its new tokens go to ``columns`` [k, g]; it attends ``used`` columns.

        ``index``: ``rows`` as a device tensor already (a captured read plans before capture: no copy inside it);
        ``rows`` None: the rows are ``index``, whichever they are (a captured read that gathers its rows);
        ``every_row_reads``: each row reads a real token (their recurrent states are then read in place where the
        rows are contiguous: ``slot_state.py``).
        """
        contiguous = rows is not None and rows == list(range(rows[0], rows[0] + len(rows)))
        self.span = slice(rows[0], rows[0] + len(rows)) if contiguous else None
        self.rows = index if index is not None else staged(rows, columns.device)
        self.columns, self.used = columns, used
        self.states.plan(self.rows, None, self.span if every_row_reads else None)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the forward's new keys and values [k, heads, g, dim]; return its rows' [k, heads, used, dim]."""
        out = []
        for store, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = store[layer_idx]
            if buffer is None:
                buffer = new.new_zeros(self.slots, new.shape[1], self.capacity + 1, new.shape[3])
                store[layer_idx] = buffer
            rows, columns = self.rows.to(buffer.device), self.columns.to(buffer.device)
            buffer[rows[:, None], :, columns] = new.transpose(1, 2)  # [k, g, heads, dim]: a row's new tokens
            if self.span is not None:
                out.append(buffer[self.span, :, : self.used])
            else:
                out.append(buffer[:, :, : self.used].index_select(0, rows))
        return out[0], out[1]

    def count_gathered(self, rows: int, used: int) -> None:
        """Add to ``gathered_bytes`` what a read gathering ``rows`` slots over ``used`` columns copies: every layer's
        keys and values of those rows and columns (from the buffers' shapes: no device value is read)."""
        self.gathered_bytes += sum(rows * b.shape[1] * used * b.shape[3] * b.element_size()
                                   for store in (self.keys, self.values) for b in store if b is not None)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.used

    # HF's recurrent layers (``slot_state.py``): a forward's rows' states, gathered, written back by ``finish``
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.states.get(layer_idx, CONV, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.states.get(layer_idx, RECURRENT, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        return self.states.update_conv(conv_states, layer_idx, state_idx, conv_kernel_size)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        return self.states.update_recurrent(recurrent_states, layer_idx, state_idx)

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False  # (a rollback restores a checkpoint: ``slot_state.py``)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # (transformers 5.25's per-token history: none kept, as ``is_recording_past`` says)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers 5.25 counts the tokens a one-token step's in-place conv update read; the slots count their
        own (``used``, the book), and the updated state is the one ``get_conv_state`` handed out (``slot_state.py``)."""

    def finish(self, real: torch.Tensor) -> None:
        """After a forward: its rows' recurrent states written back where a row read a real token (``real`` [k, g])."""
        if self.states.handed:
            self.states.real = real.any(-1)
            self.states.finish()

    def grow(self, slots: int, capacity: int) -> int:
        """At least ``slots`` rows of ``capacity`` columns (rows keep their tokens); the bytes copied."""
        slots, capacity = max(slots, self.slots), max(capacity, self.capacity)
        if (slots, capacity) == (self.slots, self.capacity):
            return 0
        copied = 0
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                if old is None:
                    continue
                new = old.new_zeros(slots, old.shape[1], capacity + 1, old.shape[3])
                new[: self.slots, :, : self.capacity] = old[:, :, : self.capacity]
                store[i] = new
                copied += old[:, :, : self.capacity].numel() * old.element_size()
        copied += self.states.grow(slots)
        self.slots, self.capacity = slots, capacity
        return copied

    def row_bytes(self, columns: int) -> int:
        """Bytes one row's first ``columns`` columns hold over every layer, its states included (0 before the first
        write)."""
        return self.states.row_bytes() + sum(b[0, :, :columns].numel() * b.element_size()
                                             for store in (self.keys, self.values) for b in store if b is not None)


# ----------------------------------------------------------------- one forward
def piece_layout(starts: torch.Tensor, counts: torch.Tensor, width: int, trash: int):
    """Where a piece's tokens come from and go: (source/target column [k, g], real [k, g], position [k, g]).

    Row i's ``counts[i]`` new tokens are at columns ``starts[i] ..`` of its row, right-aligned in the piece. Host
    tensors in, host tensors out (``piece`` stages them).
    """
    offset = torch.arange(width) - (width - counts)[:, None]  # < 0: padding
    real = offset >= 0
    column = starts[:, None] + offset
    return torch.where(real, column, trash), real, torch.where(real, column, 0)


def piece_masks(model: torch.nn.Module, real: torch.Tensor, position: torch.Tensor, used: int):
    """The forward's attention mask: a real token sees its row's columns up to its position (within its window, or
    its chunk, where the layer has one: ``LOCAL``).

    One 4-D mask; for a model whose layers differ (``layer_types``), a mapping per layer type (what HF's decoders
    take in place of the masks they would build; a decoder whose layers are all alike takes the tensor only). A
    recurrent layer takes none (``RecurrentMasks``: its rows are never padded, ``slot_state.py``); a model without
    attention layers, no mask at all.
    """
    held = layer_kinds(model)
    if "attention" not in held:
        return None
    columns = torch.arange(used, device=position.device)
    allowed = torch.where(real[..., None], columns <= position[..., None], columns == 0)  # [k, g, used]
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ()) & set(LOCAL) | {"full_attention"}
    if not getattr(config, "layer_types", None) and getattr(config, "sliding_window", None):
        kinds = {"sliding_attention"}  # a window on every layer, from ``sliding_window`` alone (Mistral, Phi-3 4k)
    masks = {}
    for kind in sorted(kinds):
        size = getattr(config, LOCAL[kind], None) if kind in LOCAL else None
        if kind == "sliding_attention" and size:
            near = columns > position[..., None] - size
        elif kind == "chunked_attention" and size:
            near = columns // size == position[..., None] // size  # (a slot's columns are its positions)
        else:
            masks[kind] = allowed
            continue
        masks[kind] = allowed & (near | ~real[..., None])
    attention = getattr(config, "_attn_implementation", None) or "eager"
    dtype = model.dtype
    for kind, mask in masks.items():
        mask = mask[:, None]  # [k, 1, g, used]
        if attention == "eager":  # HF's eager attention adds the mask to its scores
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        masks[kind] = mask
    if "recurrent" in held:
        return RecurrentMasks(masks)
    return masks if len(masks) > 1 else next(iter(masks.values()))


class RecurrentMasks(dict):
    """The masks of a hybrid decoder's attention layer types; its recurrent layer types ("linear_attention", "mamba",
    "conv": whatever a decoder names them) take None (their rows are never padded)."""

    def __missing__(self, kind: str) -> None:
        return None


def piece_inputs(tokens: torch.Tensor, rows: list[int], starts: list[int], counts: list[int], width: int,
                 trash: int) -> dict[str, torch.Tensor]:
    """The device tensors of one piece: ids, positions, cache columns and which entries are real [k, width]."""
    return piece(tokens, rows, starts, counts, width, trash)[0]


def piece(tokens: torch.Tensor, rows: list[int], starts: list[int], counts: list[int], width: int,
          trash: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``piece_inputs``, and ``rows`` as a device index. The layout is computed on the host, from host values, and
    staged (``staging.py``): two copies the host does not wait for, and one gather of the ids on the device."""
    device, k = tokens.device, len(rows)
    column, real, position = piece_layout(torch.tensor(starts), torch.tensor(counts), width, trash)
    values = staged(torch.cat([torch.tensor(rows), column.flatten(), position.flatten()]), device)
    index, column, position = values[:k], values[k : k + column.numel()], values[k + column.numel():]
    column, position = column.view(k, width), position.view(k, width)
    chosen = tokens[:k] if in_order(rows) else tokens.index_select(0, index)  # (captured reads: the first slots)
    inputs = {"ids": chosen.gather(1, position), "position": position, "column": column,
              "real": staged(real, device, torch.bool)}
    return inputs, index


def forward_piece(model: torch.nn.Module, cache: SlotCache, ids: torch.Tensor, position: torch.Tensor,
                  column: torch.Tensor, real: torch.Tensor, used: int, hidden: bool,
                  every: bool = False) -> tuple[torch.Tensor, ...]:
    """``model`` reads one planned piece (``cache.plan`` was called): logits [k, V] after each row's last token,
    and with ``hidden`` the post-norm hidden state [k, H] there (``output_hidden_states``: a hook would not
    survive compilation); with ``every``, the logits [k, g, V] after each of the piece's tokens instead. A pure
    function of its tensors: it can be captured."""
    embed_device = model.get_input_embeddings().weight.device
    masks = piece_masks(model, real.to(embed_device), position.to(embed_device), used)
    out = model(input_ids=ids.to(embed_device), attention_mask=masks, position_ids=position.to(embed_device),
                **cache_argument(cache), use_cache=True, logits_to_keep=0 if every else 1,
                output_hidden_states=hidden, return_dict=True)
    cache.finish(real)
    if every:
        return (out.logits,)
    if not hidden:
        return (out.logits[:, -1],)
    return out.logits[:, -1], out.hidden_states[-1][:, -1]


def read_piece(model: torch.nn.Module, cache: SlotCache, tokens: torch.Tensor, rows: list[int], starts: list[int],
               counts: list[int], hidden: bool = False, every: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model`` reads ``counts[i]`` tokens of row ``rows[i]`` from column ``starts[i]`` of ``tokens`` [S, C]
    into ``cache`` (eagerly); the logits [k, V] after each row's last one, and its hidden state [k, H] or None
    (with ``every``: the logits [k, g, V] after each token of the right-aligned piece, and None)."""
    inputs, index = piece(tokens, rows, starts, counts, max(counts), cache.trash)
    used = max(s + n for s, n in zip(starts, counts))
    cache.plan(rows, inputs["column"], used, index, every_row_reads=min(counts) > 0)
    if every:
        out = forward_piece(model, cache, **inputs, used=used, hidden=False, every=True)[0], None
    elif not hidden:
        out = forward_piece(model, cache, **inputs, used=used, hidden=False)[0], None
    else:
        with HiddenStateCapture(model) as capture:  # eagerly, the lm_head's input: no layer's states kept
            out = forward_piece(model, cache, **inputs, used=used, hidden=False)[0], capture.hidden[:, -1]
    if cache.span is None:  # the rows were gathered
        cache.count_gathered(len(rows), used)
    return out
