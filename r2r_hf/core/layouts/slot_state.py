"""Recurrent state in slots: each slot's conv and recurrent (state-space, linear-attention) states, read in place.

A hybrid or state-space decoder (Qwen3.5, Qwen3-Next, Nemotron-H, Jamba, Granite 4.0-H, Mamba...) keeps, per
recurrent layer, a **conv state** (the last inputs of its short convolution) and a **recurrent state** (a matrix per
head), both updated by every token it reads. There is no per-token history to slice, so three rules make slots exact:

* **a row's state advances over its real tokens only.** Padding is not neutral here (a padded position still decays
  a state and shifts a convolution's window), so a read of such a model never pads a row: every row of one forward
  reads the same number of tokens (``SlotBook.read`` with ``widths``), and a slot a forward does not read (a
  captured read's idle rows, a gathering read's fillers) keeps its state: ``finish`` writes back only the rows that
  read a real token;
* **a join starts from zero** (``reset``): a fresh state is what HF's forward starts a prompt from;
* **a rollback restores a checkpoint** (``keep`` / ``restore``): a row's state as it stood before the model read
  the row's first token that may be cut back (a speculative position), then the model reads again from there to the
  cut (``SlotLayout.cut``). A checkpoint taken earlier than needed costs a longer re-read, never a wrong state.

HF's recurrent layers ask their cache for a layer's state (``get_conv_state``, ``get_recurrent_state``), may update it
in place (a one-token step), and hand back new states (``update_conv_state``, ``update_recurrent_state``). Where a
forward's rows are a contiguous range of slots that all read a real token (an eager read: the host knows), they get
their states in place (views: nothing copied); otherwise a gathered copy, and ``finish`` (after the forward, inside a
captured read too: device ops only) writes back the copies of the rows that read a real token.
"""

from __future__ import annotations

import torch

from ..staging import staged

CONV, RECURRENT = "conv", "recurrent"


class SlotStates:
    """Per recurrent layer and kind (conv, recurrent; a layer may hold several states: ``state_idx``), a buffer of
    ``slots`` rows, allocated on the first write (its shape is the model's), and a checkpoint per slot.

    Args:
        slots: rows.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.buffers: dict[tuple[int, str, int], torch.Tensor] = {}  # (layer, kind, state) -> [slots, ...]
        self.saved: dict[tuple[int, str, int], torch.Tensor] = {}  # the checkpoints, shaped alike
        self.kernels: dict[tuple[int, int], int] = {}  # (layer, state) -> columns a conv state keeps
        self.handed: dict[tuple[int, str, int], torch.Tensor] = {}  # this forward's rows' states
        self.rows: torch.Tensor | None = None  # [k] the forward's slots
        self.real: torch.Tensor | None = None  # [k] bool: the forward's rows that read a real token
        self.span: slice | None = None  # the rows as a range of slots that all read a real token: states in place

    def plan(self, rows: torch.Tensor, real: torch.Tensor | None, span: slice | None = None) -> None:
        """The next forward reads ``rows`` [k] (a device index); ``real`` [k]: those that read a real token (set by
        ``finish``'s caller where not known yet); ``span``: the rows as a range of slots that all read one."""
        self.rows, self.real, self.span = rows, real, span
        self.handed = {}

    # ------------------------------------------------------------ HF's cache interface, per layer
    def get(self, layer: int, kind: str, state: int) -> torch.Tensor | None:
        """The forward's rows' state (a copy: written back by ``finish``), or None before the model's first write
        (the layer then starts from zeros, as it does for a prompt)."""
        key = (layer, kind, state)
        buffer = self.buffers.get(key)
        if buffer is None:
            return None
        if self.span is not None:
            return buffer[self.span]
        if key not in self.handed:
            self.handed[key] = buffer.index_select(0, self.rows.to(buffer.device))
        return self.handed[key]

    def update_conv(self, new: torch.Tensor, layer: int, state: int, kernel: int | None) -> torch.Tensor:
        """The conv inputs ``new`` [k, C, n] after the rows' kept ones: the whole window the layer convolves
        (its last ``kernel`` columns are the rows' new state)."""
        key = (layer, CONV, state)
        if key not in self.buffers:
            self.kernels[(layer, state)] = kernel or new.shape[-1]
            size = self.kernels[(layer, state)]
            self.buffers[key] = new.new_zeros(self.slots, *new.shape[1:-1], size)
        before = self.get(layer, CONV, state)
        full = torch.cat([before.to(new.dtype), new], dim=-1)
        self._put(key, full[..., -self.kernels[(layer, state)]:])
        return full

    def update_recurrent(self, new: torch.Tensor, layer: int, state: int) -> torch.Tensor:
        """The rows' new recurrent state ``new`` [k, ...]."""
        key = (layer, RECURRENT, state)
        if key not in self.buffers:
            self.buffers[key] = new.new_zeros(self.slots, *new.shape[1:])
        self._put(key, new)
        return new

    def _put(self, key: tuple[int, str, int], value: torch.Tensor) -> None:
        """The forward's rows' new state: in place where they are a range of slots, else handed to ``finish``."""
        if self.span is None:
            self.handed[key] = value
        else:
            held = self.buffers[key][self.span]
            if held.data_ptr() != value.data_ptr():
                held.copy_(value)

    def finish(self) -> None:
        """Write the forward's states back, for the rows that read a real token only (device ops: a captured read
        replays it)."""
        for key, value in self.handed.items():
            buffer = self.buffers[key]
            rows = self.rows.to(buffer.device)
            real = self.real.to(buffer.device).view(-1, *([1] * (buffer.dim() - 1)))
            buffer.index_copy_(0, rows, torch.where(real, value.to(buffer.dtype), buffer.index_select(0, rows)))
        self.handed = {}

    # ------------------------------------------------------------ joins and rollbacks
    def reset(self, row: int) -> None:
        """Slot ``row`` starts from zero states (a new answer joins it)."""
        for buffer in self.buffers.values():
            buffer[row].zero_()

    def keep(self, rows: list[int]) -> None:
        """Checkpoint the states of ``rows`` as they stand (``restore`` puts them back; before the model's first write
        every state is zero, and so is its checkpoint)."""
        if not rows:
            return
        for key, buffer in self.buffers.items():
            if key not in self.saved:
                self.saved[key] = torch.zeros_like(buffer)
            at = staged(rows, buffer.device)
            self.saved[key].index_copy_(0, at, buffer.index_select(0, at))

    def restore(self, row: int) -> None:
        """Slot ``row``'s states back to its checkpoint (zero where it was kept before the model's first write)."""
        for key, buffer in self.buffers.items():
            if key in self.saved:
                buffer[row].copy_(self.saved[key][row])
            else:
                buffer[row].zero_()

    # ------------------------------------------------------------ sizes
    def grow(self, slots: int) -> int:
        """At least ``slots`` rows (rows keep their states); the bytes copied."""
        copied = 0
        for store in (self.buffers, self.saved):
            for key, old in store.items():
                new = old.new_zeros(slots, *old.shape[1:])
                new[: self.slots] = old
                store[key] = new
                copied += old.numel() * old.element_size()
        self.slots = max(slots, self.slots)
        return copied

    def row_bytes(self) -> int:
        """Bytes one row's states hold over every layer (0 before the first write)."""
        return sum(b[0].numel() * b.element_size() for b in self.buffers.values())
