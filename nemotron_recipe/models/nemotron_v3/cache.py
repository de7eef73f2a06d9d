"""The state incremental decoding carries from step to step, for a batch of left-padded sequences.

Per Mamba2 block: the conv window (the last `conv_kernel` inputs of the depthwise conv, in the
model's dtype) and the SSM state [b, heads, head_dim, state] in fp32. Per attention block: the keys
and values [b, kv_heads, capacity, head_dim], written in place up to `length`. MLP and MoE blocks
keep nothing.

Prompts of different lengths are left-padded to one length; `valid` [b, capacity] marks the real
positions. The prefill runs padding as a separate document (`document_ids`), so neither the conv,
nor the scan, nor attention lets a real token see a pad: the Mamba states start from zero at each
row's first real token, and the attention keys of pads are masked out of every later step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import NemotronHConfig


@dataclass
class MambaState:
    conv: torch.Tensor  # [b, conv channels, conv_kernel], oldest input first
    ssm: torch.Tensor  # [b, heads, head_dim, state], fp32


@dataclass
class AttentionState:
    key: torch.Tensor  # [b, kv_heads, capacity, head_dim]
    value: torch.Tensor


class DecodeCache:
    """Decoding state of a batch: built from the prompts' validity mask, filled by the prefill (the
    model's first forward with this cache), then advanced one position per decoding step.

    prompt_valid [b, L] bool: the real tokens of each left-padded prompt (a suffix of each row).
    capacity: the most positions the cache will hold (prompt length plus new tokens)."""

    def __init__(self, prompt_valid: torch.Tensor, capacity: int, num_layers: int):
        b, length = prompt_valid.shape
        if capacity < length:
            raise ValueError(f"capacity={capacity} is shorter than the prompts ({length} positions)")
        self.capacity = capacity
        self.length = 0  # positions already in the cache
        self.valid = torch.zeros(b, capacity, dtype=torch.bool, device=prompt_valid.device)
        self.valid[:, :length] = prompt_valid
        # Read once here: without padding the decoding steps' attention needs no mask at all.
        self.padded = not bool(prompt_valid.all())
        self.layers: list[MambaState | AttentionState | None] = [None] * num_layers
        # Per layer, what its steps derive from the weights (dtype casts, -exp(A_log), ...), made at the
        # first step: the weights do not change while one cache decodes.
        self.step_constants: list[tuple | None] = [None] * num_layers

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def prefilled(self) -> bool:
        return self.length > 0

    def document_ids(self, new: int) -> torch.Tensor | None:
        """For the prefill of `new` positions: 0 on padding, 1 on real tokens; None without padding."""
        valid = self.valid[:, :new]
        return None if bool(valid.all()) else valid.long()

    def token_mask(self, new: int) -> torch.Tensor | None:
        """Real tokens of the prefill (None without padding): padding stays out of MoE expert loads."""
        valid = self.valid[:, :new]
        return None if bool(valid.all()) else valid

    def keys_mask(self, new: int) -> torch.Tensor | None:
        """[b, 1, 1, length + new]: the positions a decoding step's queries attend to; None when the
        prompts had no padding (every cached position is then real)."""
        return self.valid[:, None, None, :self.length + new] if self.padded else None

    def begin_step(self, new: int) -> None:
        """Marks `new` decoded positions real before the model runs them."""
        if self.length + new > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {self.length} used, {new} more asked")
        self.valid[:, self.length:self.length + new] = True

    def advance(self, new: int) -> None:
        self.length += new

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the batch rows `rows` (indices), e.g. once the others have finished."""
        self.valid = self.valid[rows]
        for i, state in enumerate(self.layers):
            if isinstance(state, MambaState):
                self.layers[i] = MambaState(state.conv[rows], state.ssm[rows])
            elif isinstance(state, AttentionState):
                self.layers[i] = AttentionState(state.key[rows], state.value[rows])

    def nbytes(self) -> int:
        """Bytes the per-block states hold (the validity mask aside)."""
        total = 0
        for state in self.layers:
            if isinstance(state, MambaState):
                total += state.conv.nbytes + state.ssm.nbytes
            elif isinstance(state, AttentionState):
                total += state.key.nbytes + state.value.nbytes
        return total


def cache_bytes(config: NemotronHConfig, batch: int, length: int, dtype: torch.dtype) -> int:
    """The cache's size by formula: per Mamba2 block the conv window (conv channels x kernel, in
    `dtype`) plus the SSM state (heads x head_dim x state, fp32); per attention block
    2 x kv_heads x head_dim x `length` (in `dtype`); times `batch`."""
    item = torch.empty((), dtype=dtype).element_size()
    conv_channels = config.mamba_num_heads * config.mamba_head_dim + 2 * config.n_groups * config.ssm_state_size
    mamba = conv_channels * config.conv_kernel * item + config.mamba_num_heads * config.mamba_head_dim \
        * config.ssm_state_size * 4
    attention = 2 * config.num_key_value_heads * config.head_dim * length * item
    kinds = config.block_types
    return batch * (kinds.count("mamba") * mamba + kinds.count("attention") * attention)
